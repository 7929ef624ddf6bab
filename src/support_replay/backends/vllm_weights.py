"""Weights into vLLM 0.32 on the CPU (docs/engines.md, observed on a running server): the dev-mode routes of a
server started with ``VLLM_SERVER_DEV_MODE=1``: ``/pause?mode=wait`` (finish what runs, clear the prefix
cache), ``/collective_rpc`` ``reload_weights`` from a directory, ``/update_weight_version``, ``/resume``."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import torch

from .weight_push import ADAPTER_NAME, AdapterSync, StagedSync, post_admin

DEV_MODE_HINT = "start the vLLM server with VLLM_SERVER_DEV_MODE=1 so that it mounts its weight-reload routes"
ADAPTER_HINT = (
    "start the vLLM server with --enable-lora --max-lora-rank R and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True so that it "
    "mounts its adapter routes"
)
post_dev = partial(post_admin, hint_404=DEV_MODE_HINT)  # the dev-mode routes


class VLLMSync(StagedSync):
    def push(self, state: dict[str, torch.Tensor], version: str) -> None:
        path = self.stage(state)
        post_dev(self.url, "/pause", "pausing generation", params={"mode": "abort" if self.abort else "wait"})
        try:
            post_dev(
                self.url,
                "/collective_rpc",
                "reloading the weights",
                json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}},
            )
            post_dev(self.url, "/update_weight_version", "naming the weights", json={"new_version": version})
        finally:
            post_dev(self.url, "/resume", "resuming generation")


class VLLMAdapterSync(AdapterSync):
    """vLLM 0.32 (observed on the CPU server): generation paused as for a weight reload, ``/v1/load_lora_adapter``
    with ``load_inplace`` (one name, replaced in place; needs ``--enable-lora --max-lora-rank R`` and
    ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``), ``/update_weight_version`` (``VLLM_SERVER_DEV_MODE=1``), resumed."""

    def load(self, path: Path, version: str) -> None:
        post_dev(self.url, "/pause", "pausing generation", params={"mode": "abort" if self.abort else "wait"})
        try:
            body = {"lora_name": ADAPTER_NAME, "lora_path": str(path), "load_inplace": True}
            post_admin(self.url, "/v1/load_lora_adapter", "loading the adapter", hint_404=ADAPTER_HINT, json=body)
            post_dev(self.url, "/update_weight_version", "naming the weights", json={"new_version": version})
        finally:
            post_dev(self.url, "/resume", "resuming generation")
