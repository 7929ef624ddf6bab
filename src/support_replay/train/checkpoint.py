"""Checkpoints: model, optimizer, RNG and the data position; resume continues exactly."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

from .weights import save_safetensors

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def save_checkpoint(directory: Path, rollout: int, actor, ctx, extra: dict) -> Path | None:
    """``directory/rollout_{rollout}`` written atomically by rank 0 (all ranks must call it)."""
    model_state = actor.full_state_dict()
    optim_state = get_optimizer_state_dict(actor.model, actor.optimizer, options=_FULL)
    target = Path(directory) / f"rollout_{rollout:06d}"
    if ctx.is_main:
        staging = Path(directory) / f".rollout_{rollout:06d}.tmp"
        if staging.exists():
            shutil.rmtree(staging)
        save_safetensors(model_state, staging)
        torch.save({"optimizer": optim_state, "rng": _rng_state()}, staging / "trainer.pt")
        (staging / "state.json").write_text(json.dumps({"rollout": rollout, **extra}, indent=2))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    if dist.is_initialized():
        dist.barrier()
    return target


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted(Path(directory).glob("rollout_*")) if Path(directory).exists() else []
    return found[-1] if found else None


def saved_rollout(path: Path) -> int:
    """How many rollouts the checkpoint at ``path`` had trained."""
    return int(json.loads((Path(path) / "state.json").read_text())["rollout"])


def load_checkpoint(path: Path, actor) -> dict:
    """Load model, optimizer and RNG on every rank; returns the saved state.json."""
    actor.load_full_state_dict(load_file(str(path / "model.safetensors")))
    trainer = torch.load(path / "trainer.pt", weights_only=False)
    set_optimizer_state_dict(actor.model, actor.optimizer, trainer["optimizer"], options=StateDictOptions(full_state_dict=True))
    _set_rng_state(trainer["rng"])
    return json.loads((path / "state.json").read_text())
