"""Weights into a running engine: safetensors files or tensors in memory, checked before any is copied."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import RequestError


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise RequestError(f"model_path: no .safetensors file at {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy ``state`` into ``model`` in place (views such as the fused step's see it); every name and
    shape is checked first, so a bad update changes nothing."""
    params = model.state_dict(keep_vars=True)  # tied weights appear under every name
    unknown = [k for k in state if k not in params]
    if unknown:
        raise RequestError(f"unknown parameter {unknown[0]!r} ({len(unknown)} in all)")
    for name, tensor in state.items():
        if params[name].shape != tensor.shape:
            raise RequestError(f"parameter {name!r}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
    with torch.no_grad():
        for name, tensor in state.items():
            params[name].copy_(tensor)


def load_update(model: torch.nn.Module, source) -> None:
    """An update's weights: a path to read, tensors, a function of the model that gives them (a LoRA
    adapter's merge, computed when the update applies), or ``None`` (a rename only)."""
    if callable(source):
        source = source(model)
    if source is not None:
        load_state(model, load_safetensors(source) if isinstance(source, Path) else source)
