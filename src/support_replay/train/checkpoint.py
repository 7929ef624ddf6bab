"""Checkpoints: model, optimizer, learning-rate schedule, RNG and the data position; resume continues exactly.

A checkpoint is written under a temporary name, every file fsynced, a manifest of SHA-256
sums written last, the directory renamed into place and its parent fsynced: a crash at any
moment leaves either no checkpoint or a whole one. Resume takes the newest checkpoint whose
files match their manifest (a damaged or half-copied one is skipped, and named in the log).
``trainer.pt`` holds tensors, numbers and lists only and is read with ``weights_only=True``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict
from transformers import AutoTokenizer

from ..backends.weight_push import save_safetensors
from ..errors import ConfigError, SupportReplayError

log = logging.getLogger(__name__)

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
MANIFEST = "manifest.json"
ADAPTER_FILE = "adapter_model.safetensors"  # peft's name


def _rng_state() -> dict:
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    version, state, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)],
        "python": [version, list(state), gauss],
    }


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    version, values, gauss = state["python"]
    random.setstate((version, tuple(values), gauss))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _loadable(staging: Path, actor) -> None:
    """The model's config and the run's tokenizer beside its weights: a checkpoint is a Hugging Face checkpoint
    (``from_pretrained``, ``--hf-checkpoint``, a distillation teacher's ``--opd-teacher-load``)."""
    actor.model.hf.config.save_pretrained(staging)
    source = getattr(actor, "source", None)
    if source is not None:
        AutoTokenizer.from_pretrained(source).save_pretrained(staging)


def save_checkpoint(directory: Path, rollout: int, actor, ctx, extra: dict) -> Path | None:
    """``directory/rollout_{rollout}`` written atomically and durably by rank 0 (all ranks must call it)."""
    model_state, adapter = actor.checkpoint_state()  # with LoRA: merged (a Hugging Face checkpoint) and the adapter
    optim_state = get_optimizer_state_dict(actor.model, actor.optimizer, options=_FULL)
    directory = Path(directory)
    target = directory / f"rollout_{rollout:06d}"
    if ctx.is_main:
        staging = directory / f".rollout_{rollout:06d}.tmp"
        if staging.exists():
            shutil.rmtree(staging)
        save_safetensors(model_state, staging)
        _loadable(staging, actor)
        if adapter is not None:  # the adapter alone, as peft saves one (PeftModel.from_pretrained reads it)
            save_file(adapter, str(staging / ADAPTER_FILE))
            actor.lora.peft_config().save_pretrained(str(staging))
        schedule = (
            {"settings": actor.schedule, "state": actor.scheduler.state_dict()} if actor.scheduler is not None else None
        )
        torch.save({"optimizer": optim_state, "scheduler": schedule, "rng": _rng_state()}, staging / "trainer.pt")
        (staging / "state.json").write_text(json.dumps({"rollout": rollout, **extra}, indent=2))
        files = sorted(p for p in staging.iterdir() if p.is_file())
        for path in files:
            _fsync(path)
        (staging / MANIFEST).write_text(json.dumps({p.name: _sha256(p) for p in files}, indent=2))
        _fsync(staging / MANIFEST)
        _fsync(staging)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
        _fsync(directory)
    if dist.is_initialized():
        dist.barrier()
    return target


def verify_checkpoint(path: Path) -> str | None:
    """None when every file of ``path`` matches its manifest; otherwise what is wrong."""
    manifest = Path(path) / MANIFEST
    if not manifest.exists():
        return "no manifest (written before it was complete, or not by this version)"
    try:
        sums = json.loads(manifest.read_text())
    except ValueError as exc:
        return f"unreadable manifest: {exc}"
    for name, expected in sums.items():
        file = Path(path) / name
        if not file.exists():
            return f"{name} is missing"
        if _sha256(file) != expected:
            return f"{name} does not match its checksum"
    return None


def latest_checkpoint(directory: Path) -> Path | None:
    """The newest checkpoint of ``directory`` that verifies; damaged ones are skipped, with a warning."""
    found = sorted(Path(directory).glob("rollout_*"), reverse=True) if Path(directory).exists() else []
    for path in found:
        problem = verify_checkpoint(path)
        if problem is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, problem)
    return None


def saved_rollout(path: Path) -> int:
    """How many rollouts the checkpoint at ``path`` had trained."""
    return int(json.loads((Path(path) / "state.json").read_text())["rollout"])


def load_checkpoint(path: Path, actor) -> dict:
    """Load model, optimizer and RNG on every rank; returns the saved state.json."""
    problem = verify_checkpoint(path)
    if problem is not None:
        raise SupportReplayError(f"checkpoint {path}: {problem}")
    if actor.lora is not None:  # the base stays the run's checkpoint; the adapter goes on where it was
        if not (path / ADAPTER_FILE).exists():
            raise ConfigError(
                f"checkpoint {path}: has no LoRA adapter ({ADAPTER_FILE}); was it saved with --lora-rank?"
            )
        actor.load_adapter_state_dict(load_file(str(path / ADAPTER_FILE)))
    else:
        if (path / ADAPTER_FILE).exists():
            raise ConfigError(f"checkpoint {path}: holds a LoRA adapter; resume it with the run's --lora-rank")
        actor.load_full_state_dict(load_file(str(path / "model.safetensors")))
    trainer = torch.load(path / "trainer.pt", weights_only=True)
    set_optimizer_state_dict(
        actor.model, actor.optimizer, trainer["optimizer"], options=StateDictOptions(full_state_dict=True)
    )
    _load_schedule(path, actor, trainer.get("scheduler"))
    _set_rng_state(trainer["rng"])
    return json.loads((path / "state.json").read_text())


def _load_schedule(path: Path, actor, saved: dict | None) -> None:
    """The learning-rate schedule goes on where it was, if it is the run's (Megatron checks the same)."""
    mine, theirs = actor.schedule, saved["settings"] if saved is not None else None
    if mine != theirs:
        raise ConfigError(
            f"checkpoint {path}: saved with the learning-rate schedule {theirs}, this run's is {mine}; resume with "
            "the same --lr, --lr-warmup-*, --lr-decay-*, --min-lr and run length (or give --lr-decay-iters)"
        )
    if saved is not None:
        actor.scheduler.load_state_dict(saved["state"])


def save_if_due(directory: str, interval: int, rollout: int, actor, ctx, row: dict) -> None:
    """``--save DIR --save-interval N``: a checkpoint after every N-th rollout (all ranks call it)."""
    if directory and interval and (rollout + 1) % interval == 0:
        save_checkpoint(Path(directory), rollout + 1, actor, ctx, {"metrics": row})
