"""Weights into a running engine: safetensors files or tensors in memory, checked before any is copied."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import RequestError


def outside(path: Path, root: Path) -> str | None:
    """Why ``path`` may not be read as weights from under ``root`` (None when it may): it must resolve under
    ``root``, and so must every entry of the directory it names (links resolved; ``adapter_config.json`` and an
    index as well as the safetensors files)."""
    resolved = Path(path).resolve()
    if not resolved.is_relative_to(root):
        return f"{str(path)!r} is not under the weights directory {str(root)!r}"
    entries = sorted(resolved.iterdir()) if resolved.is_dir() else []
    away = [e for e in entries if not e.resolve().is_relative_to(root)]
    if away:  # a link inside the directory to a file elsewhere
        return f"{str(path)!r}: {away[0].name} resolves outside the weights directory {str(root)!r}"
    return None


@dataclass(frozen=True)
class CheckedPath:
    """A weights path checked against ``root`` again when it is read, on the engine's thread, not only when the
    request came: an update waits for the running batch to drain, and a link may change meanwhile."""

    path: Path
    root: Path

    def read(self) -> dict[str, torch.Tensor]:
        refused = outside(self.path, self.root)
        if refused is not None:
            raise RequestError(f"model_path: {refused}")
        return load_safetensors(self.path.resolve())


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
    """An update's weights: a path to read (a ``CheckedPath`` is checked again as it is read), tensors, a
    function of the model that gives them (a LoRA adapter's merge, computed when the update applies), or
    ``None`` (a rename only)."""
    if callable(source):
        source = source(model)
    if source is not None:
        if isinstance(source, CheckedPath):
            source = source.read()
        load_state(model, load_safetensors(source) if isinstance(source, Path) else source)
