"""Weights into an SGLang-speaking engine: SGLang, our ``serve`` and router, smg.

- ``SGLangSync``: ``POST /update_weights_from_disk {"model_path", "weight_version"}`` (SGLang's route; our
  router broadcasts it to every engine). smg 1.13 does not route it (404); with ``--enable-rl`` it fans it
  out as ``POST /v1/rl/engine/update_weights_from_disk?selector=engine=sglang`` (observed here), which the
  sync falls back to.
- ``BodySync`` (``--weight-transport http``): the same safetensors file as the body of
  ``POST /update_weights_from_safetensors`` (our ``serve`` and router, admin key required): one copy of the
  weights per push over the network, no pickle.
- ``SGLangAdapterSync`` (``--lora-sync adapter``): SGLang's adapter routes.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import torch

from ..errors import SupportReplayError
from ..serving.security import WEIGHTS_OVER_HTTP, Keys
from .weight_push import (
    ADAPTER_NAME,
    SYNC_TIMEOUT,
    AdapterSync,
    StagedSync,
    check_success,
    paused_generation,
    post_admin,
)

SMG_RL = "/v1/rl/engine"  # smg --enable-rl: its control plane fans /v1/rl/engine/<route> out to every engine


class SGLangSync(StagedSync):
    def push(self, state: dict[str, torch.Tensor], version: str) -> None:
        body = {"model_path": str(self.stage(state)), "weight_version": version, "abort_all_requests": self.abort}
        with paused_generation(self.url, self.mode, self._call):  # retract, in_place: under running requests
            self._call("/update_weights_from_disk", "loading the weights", body)

    def _call(self, path: str, what: str, body: dict) -> None:
        """One SGLang admin call (a load, a pause, a continue), straight to the engine, or fanned out by smg's RL
        control plane (``/v1/rl/engine{path}``), which answers the direct path 404 and lists its workers."""
        try:
            headers = Keys.load().header(admin=True)
            reply = httpx.post(self.url + path, json=body, timeout=SYNC_TIMEOUT, headers=headers)
        except httpx.HTTPError as exc:
            raise SupportReplayError(
                f"weight sync to {self.url}: {what} ({path}) failed: {type(exc).__name__}: {exc}"
            ) from exc
        if reply.status_code == 404 and self._is_smg():
            fanned = post_admin(self.url, SMG_RL + path, what, params={"selector": "engine=sglang"}, json=body)
            return self._check_fanout(fanned, what)
        if reply.status_code == 404:
            raise SupportReplayError(
                f"weight sync to {self.url}: {path} is not routed there (HTTP 404); "
                "if it is smg, start it with --enable-rl so that its RL control plane can fan the call out"
            )
        if reply.status_code != 200:
            raise SupportReplayError(
                f"weight sync to {self.url}: {path} answered HTTP {reply.status_code}: {reply.text[:300]}"
            )
        check_success(self.url, reply.json() if reply.content else {})

    def _is_smg(self) -> bool:
        headers = Keys.load().header(admin=True)
        return httpx.get(self.url + "/v1/rl/workers", timeout=30, headers=headers).status_code == 200

    def _check_fanout(self, reply: httpx.Response, what: str) -> None:
        """Every engine smg fanned the call out to answered 200 (and, for a load, ``success``)."""
        results = reply.json().get("results") or {}
        if not results:
            raise SupportReplayError(f"weight sync to {self.url}: smg found no engine for {what}")
        for worker, result in results.items():
            if result.get("status") != 200:
                raise SupportReplayError(
                    f"weight sync to {self.url}: engine {result.get('url', worker)} answered HTTP "
                    f"{result.get('status')}: {str(result.get('body'))[:300]}"
                )
            check_success(result.get("url", worker), result.get("body") or {})


class BodySync:
    """The weights in the request body (our serve, or our router, which sends them to every engine)."""

    def __init__(self, url: str, mode: str = "wait"):
        self.url, self.mode, self.abort = url.rstrip("/"), mode, mode == "abort"

    def push(self, state: dict[str, torch.Tensor], version: str) -> None:
        from safetensors.torch import save

        body = save({k: v.detach().contiguous() for k, v in state.items()})
        with paused_generation(self.url, self.mode):  # retract, in_place: the load lands under running requests
            self._send(body, version)

    def _send(self, body: bytes, version: str) -> None:
        headers = {**Keys.load().header(admin=True), "Content-Type": "application/octet-stream"}
        params = {"weight_version": version, "abort_all_requests": str(self.abort).lower()}
        try:
            reply = httpx.post(
                self.url + WEIGHTS_OVER_HTTP, content=body, params=params, headers=headers, timeout=SYNC_TIMEOUT
            )
        except httpx.HTTPError as exc:
            raise SupportReplayError(
                f"weight sync to {self.url}: sending {len(body)} bytes of weights failed: {type(exc).__name__}: {exc}"
            ) from exc
        if reply.status_code == 404:
            raise SupportReplayError(
                f"weight sync to {self.url}: {WEIGHTS_OVER_HTTP} is not served there (HTTP 404): --weight-transport "
                "http needs "
                "support-replay serve or router; SGLang and vLLM load from a directory (--weight-transport disk)"
            )
        if reply.status_code != 200:
            raise SupportReplayError(
                f"weight sync to {self.url}: {WEIGHTS_OVER_HTTP} answered HTTP {reply.status_code}: {reply.text[:300]}"
            )
        check_success(self.url, reply.json() if reply.content else {})


class SGLangAdapterSync(AdapterSync):
    """SGLang's routes (and our serve's, through our router): ``/unload_lora_adapter`` (after the first push),
    ``/load_lora_adapter`` (SGLang 0.5.23 refuses to load a name or a path that is loaded), then
    ``/update_weight_version``."""

    def load(self, path: Path, version: str) -> None:
        if self.loaded is not None:
            post_admin(self.url, "/unload_lora_adapter", "unloading the last adapter", json={"lora_name": ADAPTER_NAME})
        body = {"lora_name": ADAPTER_NAME, "lora_path": str(path)}
        reply = post_admin(self.url, "/load_lora_adapter", "loading the adapter", json=body)
        check_success(self.url, reply.json() if reply.content else {})
        post_admin(self.url, "/update_weight_version", "naming the weights", json={"new_version": version})
