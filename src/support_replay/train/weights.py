"""Weights out of the actor into the rollout engine, under the version name the trainer gives them.

- ``InProcessSync``: the colocated engine, tensors in memory.
- ``SGLangSync``: our server, our router, SGLang or a router in front of them:
  ``POST /update_weights_from_disk {"model_path", "weight_version"}`` (SGLang's route; our
  router broadcasts it to every engine). smg 1.13 does not route it (404); with ``--enable-rl``
  it fans it out as ``POST /v1/rl/engine/update_weights_from_disk?selector=engine=sglang``
  (observed here), which the sync falls back to.
- ``VLLMSync``: vLLM 0.32 on the CPU (docs/engines.md, observed on a running server): the
  dev-mode routes of a server started with ``VLLM_SERVER_DEV_MODE=1``:
  ``/pause?mode=wait`` (finish what runs, clear the prefix cache), ``/collective_rpc``
  ``reload_weights`` from a directory, ``/update_weight_version``, ``/resume``.

Requests running when weights arrive either finish on the old weights first (``wait``, the
default of every engine here) or are aborted so the weights apply at once (``abort``: SGLang's
``abort_all_requests``, vLLM's ``/pause?mode=abort``); the aborted responses come back failed
and their groups are regenerated or dropped by ``--failed-group-policy``.

The HTTP syncs stage ``model.safetensors`` in a directory the engine can read (a shared
filesystem); it is written beside its final name and renamed, never read half-written. Without
a shared filesystem (``--weight-transport http``), ``BodySync`` sends the same safetensors file
as the body of ``POST /update_weights_from_safetensors`` (our ``serve`` and router, admin key
required): one copy of the weights per push over the network, no pickle.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from ..errors import SupportReplayError
from ..serving.security import WEIGHTS_OVER_HTTP, Keys

SYNC_TIMEOUT = 600.0


def save_safetensors(state: dict[str, torch.Tensor], directory: Path) -> Path:
    """Write ``model.safetensors`` atomically (tied weights are stored once per name)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "model.safetensors.tmp"
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(tmp))
    os.replace(tmp, directory / "model.safetensors")
    return directory / "model.safetensors"


def _post(url: str, path: str, what: str, **kwargs) -> httpx.Response:
    try:
        reply = httpx.post(url + path, timeout=SYNC_TIMEOUT, headers=Keys.load().header(admin=True), **kwargs)
    except httpx.HTTPError as exc:
        raise SupportReplayError(f"weight sync to {url}: {what} ({path}) failed: {type(exc).__name__}: {exc}") from exc
    if reply.status_code != 200:
        hint = ""
        if reply.status_code == 404 and path in ("/collective_rpc", "/pause", "/update_weight_version"):
            hint = "; start the vLLM server with VLLM_SERVER_DEV_MODE=1 so that it mounts its weight-reload routes"
        if reply.status_code == 404 and path == "/v1/load_lora_adapter":
            hint = (
                "; start the vLLM server with --enable-lora --max-lora-rank R and "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True so that it mounts its adapter routes"
            )
        raise SupportReplayError(
            f"weight sync to {url}: {what} ({path}) answered HTTP {reply.status_code}: {reply.text[:300]}{hint}"
        )
    return reply


WEIGHT_SYNC_MODES = ("wait", "abort")


class InProcessSync:
    def __init__(self, engine, mode: str = "wait"):
        self.engine, self.abort = engine, mode == "abort"

    def push(self, state: dict[str, torch.Tensor], version: str) -> None:
        update = self.engine.update_weights(state, version, abort_all_requests=self.abort)
        self.engine.wait([update])  # runs the engine's steps here when its loop is not started
        update.result()


class _StagedSync:
    def __init__(self, url: str, staging: Path, mode: str = "wait"):
        self.url, self.staging, self.abort = url.rstrip("/"), Path(staging), mode == "abort"

    def stage(self, state: dict[str, torch.Tensor]) -> Path:
        if self.staging.exists():
            shutil.rmtree(self.staging)
        save_safetensors(state, self.staging)
        return self.staging


SMG_FANOUT = "/v1/rl/engine/update_weights_from_disk"


class SGLangSync(_StagedSync):
    def push(self, state: dict[str, torch.Tensor], version: str) -> None:
        body = {"model_path": str(self.stage(state)), "weight_version": version, "abort_all_requests": self.abort}
        try:
            reply = httpx.post(
                self.url + "/update_weights_from_disk",
                json=body,
                timeout=SYNC_TIMEOUT,
                headers=Keys.load().header(admin=True),
            )
        except httpx.HTTPError as exc:
            raise SupportReplayError(
                f"weight sync to {self.url}: loading the weights failed: {type(exc).__name__}: {exc}"
            ) from exc
        if (
            reply.status_code == 404
            and httpx.get(self.url + "/v1/rl/workers", timeout=30, headers=Keys.load().header(admin=True)).status_code
            == 200
        ):
            return self._through_smg(body)  # smg: its RL control plane fans the call out
        if reply.status_code == 404:
            raise SupportReplayError(
                f"weight sync to {self.url}: /update_weights_from_disk is not routed there (HTTP 404); "
                "if it is smg, start it with --enable-rl so that its RL control plane can fan the call out"
            )
        if reply.status_code != 200:
            raise SupportReplayError(
                f"weight sync to {self.url}: /update_weights_from_disk answered HTTP {reply.status_code}: "
                f"{reply.text[:300]}"
            )
        _check_success(self.url, reply.json() if reply.content else {})

    def _through_smg(self, body: dict) -> None:
        reply = _post(
            self.url, SMG_FANOUT, "fanning the weights out through smg", params={"selector": "engine=sglang"}, json=body
        )
        results = reply.json().get("results") or {}
        if not results:
            raise SupportReplayError(f"weight sync to {self.url}: smg found no engine to load the weights into")
        for worker, result in results.items():
            if result.get("status") != 200:
                raise SupportReplayError(
                    f"weight sync to {self.url}: engine {result.get('url', worker)} answered HTTP "
                    f"{result.get('status')}: {str(result.get('body'))[:300]}"
                )
            _check_success(result.get("url", worker), result.get("body") or {})


def _check_success(where: str, answer) -> None:
    """SGLang answers 200 with ``success: false`` when it could not load; our router lists every engine."""
    if isinstance(answer, dict) and answer.get("success") is False:
        raise SupportReplayError(f"weight sync to {where}: the engine refused the weights: {str(answer)[:300]}")


class BodySync:
    """The weights in the request body (our serve, or our router, which sends them to every engine)."""

    def __init__(self, url: str, mode: str = "wait"):
        self.url, self.abort = url.rstrip("/"), mode == "abort"

    def push(self, state: dict[str, torch.Tensor], version: str) -> None:
        from safetensors.torch import save

        body = save({k: v.detach().contiguous() for k, v in state.items()})
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
        _check_success(self.url, reply.json() if reply.content else {})


class VLLMSync(_StagedSync):
    def push(self, state: dict[str, torch.Tensor], version: str) -> None:
        path = self.stage(state)
        _post(self.url, "/pause", "pausing generation", params={"mode": "abort" if self.abort else "wait"})
        try:
            _post(
                self.url,
                "/collective_rpc",
                "reloading the weights",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            )
            _post(self.url, "/update_weight_version", "naming the weights", json={"new_version": version})
        finally:
            _post(self.url, "/resume", "resuming generation")


ADAPTER_NAME = "policy"  # the name the trainer's LoRA adapter is loaded under (--lora-sync adapter)


class _AdapterSync:
    """``--lora-sync adapter``: the LoRA adapter alone, as peft saves one, in a directory per version the
    engine reads, loaded under ``ADAPTER_NAME``; requests name it (SGLang's ``lora_path``, vLLM's ``model``)."""

    takes_adapter = True

    def __init__(self, url: str, staging: Path, lora, mode: str = "wait"):
        self.url, self.staging, self.lora, self.abort = url.rstrip("/"), Path(staging), lora, mode == "abort"
        self.loaded: Path | None = None

    def stage(self, adapter: dict[str, torch.Tensor], version: str) -> Path:
        from safetensors.torch import save_file

        path = self.staging / f"adapter-{version}"
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        save_file({k: v.detach().contiguous() for k, v in adapter.items()}, str(path / "adapter_model.safetensors"))
        self.lora.peft_config().save_pretrained(str(path))
        return path

    def push(self, adapter: dict[str, torch.Tensor], version: str) -> None:
        path = self.stage(adapter, version)
        self.load(path, version)
        if self.loaded is not None and self.loaded != path:
            shutil.rmtree(self.loaded, ignore_errors=True)  # the engine read it at the last push
        self.loaded = path


class SGLangAdapterSync(_AdapterSync):
    """SGLang's routes (and our serve's, through our router): ``/unload_lora_adapter`` (after the first push),
    ``/load_lora_adapter`` (SGLang 0.5.23 refuses to load a name or a path that is loaded), then
    ``/update_weight_version``."""

    def load(self, path: Path, version: str) -> None:
        if self.loaded is not None:
            _post(self.url, "/unload_lora_adapter", "unloading the last adapter", json={"lora_name": ADAPTER_NAME})
        body = {"lora_name": ADAPTER_NAME, "lora_path": str(path)}
        reply = _post(self.url, "/load_lora_adapter", "loading the adapter", json=body)
        _check_success(self.url, reply.json() if reply.content else {})
        _post(self.url, "/update_weight_version", "naming the weights", json={"new_version": version})


class VLLMAdapterSync(_AdapterSync):
    """vLLM 0.32 (observed on the CPU server): generation paused as for a weight reload, ``/v1/load_lora_adapter``
    with ``load_inplace`` (one name, replaced in place; needs ``--enable-lora --max-lora-rank R`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), ``/update_weight_version`` (``VLLM_SERVER_DEV_MODE=1``), resumed."""

    def load(self, path: Path, version: str) -> None:
        _post(self.url, "/pause", "pausing generation", params={"mode": "abort" if self.abort else "wait"})
        try:
            body = {"lora_name": ADAPTER_NAME, "lora_path": str(path), "load_inplace": True}
            _post(self.url, "/v1/load_lora_adapter", "loading the adapter", json=body)
            _post(self.url, "/update_weight_version", "naming the weights", json={"new_version": version})
        finally:
            _post(self.url, "/resume", "resuming generation")


def make_weight_sync(
    *,
    engine=None,
    url: str | None = None,
    rollout_engine: str = "sglang",
    staging: Path | None = None,
    mode: str = "wait",
    transport: str = "disk",
    adapter=None,
):
    """The sync for the run's rollout engine: in-process, or over HTTP to an SGLang- or vLLM-speaking
    URL; ``mode`` (``WEIGHT_SYNC_MODES``) says what happens to requests in flight, ``transport``
    whether the weights go through a shared directory (``disk``) or the request body (``http``);
    ``adapter`` (the LoRA settings, ``--lora-sync adapter``): the adapter alone to an SGLang-speaking URL."""
    if mode not in WEIGHT_SYNC_MODES:
        raise SupportReplayError(f"weight sync mode: one of {WEIGHT_SYNC_MODES}, got {mode!r}")
    if engine is not None:
        return InProcessSync(engine, mode)
    if url is None:
        return None
    if adapter is not None:
        return (VLLMAdapterSync if rollout_engine == "vllm" else SGLangAdapterSync)(url, staging, adapter, mode)
    if transport == "http":
        return BodySync(url, mode)
    return (VLLMSync if rollout_engine == "vllm" else SGLangSync)(url, staging, mode)
