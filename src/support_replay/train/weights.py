"""Weights out of the sharded actor: to the colocated engine, or to engines over HTTP."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import torch
from safetensors.torch import save_file

from ..errors import SupportReplayError


def save_safetensors(state: dict[str, torch.Tensor], directory: Path) -> Path:
    """Write ``model.safetensors`` atomically (tied weights are stored once per name)."""
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / "model.safetensors.tmp"
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, str(tmp))
    os.replace(tmp, directory / "model.safetensors")
    return directory / "model.safetensors"


class WeightSync:
    """Push the actor's weights to the rollout engine(s) after each update."""

    def __init__(self, *, engine=None, url: str | None = None, staging: Path | None = None):
        self.engine, self.url, self.staging = engine, url, staging

    def push(self, state: dict[str, torch.Tensor], version: str) -> str | None:
        """Load ``state`` into the engine(s) under the name ``version``; returns the version they report."""
        if self.engine is not None:
            return self.engine.update_weights(state, version).result()
        if self.url is not None:
            if self.staging.exists():
                shutil.rmtree(self.staging)
            save_safetensors(state, self.staging)
            body = {"model_path": str(self.staging), "weight_version": version}
            reply = httpx.post(self.url.rstrip("/") + "/update_weights_from_disk", json=body, timeout=600)
            if reply.status_code != 200:
                raise SupportReplayError(f"weight sync to {self.url} failed: HTTP {reply.status_code} {reply.text[:300]}")
            body = reply.json()
            return body.get("weight_version")
        return None
