"""A LoRA adapter served merged into the engine's weights: SGLang's ``/load_lora_adapter`` and
``/unload_lora_adapter``, for a trainer that sends the adapter alone (``--lora-sync adapter``).

The adapter is a directory as peft saves one (``adapter_config.json``, ``adapter_model.safetensors``
with ``base_model.model.<module>.lora_A.weight`` names). Loading it replaces each adapted layer's
weight by ``W + alpha / r B A``, computed by ``modeling.lora.merge_weight``, the function the trainer
merges with, from the engine's own base weights, which are kept and put back on unload. The engine
holds one adapter at a time and so serves either the base model or that adapter: a request names the
loaded adapter in ``lora_path`` (SGLang's field), and one that names another, or none while an
adapter is loaded, is refused (it would get other weights than it asked for). As in SGLang 0.5.23
(``lora_manager.py``), loading a name that is loaded is refused: a new adapter under the same name is
an unload and a load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from ..errors import RequestError
from ..modeling.lora import merge_weight

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    scaling: float
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]  # weight name -> (A, B)


def read_adapter(name: str, path: str | Path, model) -> Adapter:
    """The adapter at ``path`` for ``model``, every name and shape checked against it (nothing changes yet)."""
    path = Path(path)
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (OSError, ValueError) as exc:
        raise RequestError(
            f"lora_path: {path} is not a peft adapter directory ({CONFIG_FILE}, {WEIGHTS_FILE}): {exc}"
        ) from None
    for key in ("use_dora", "use_rslora", "lora_bias", "fan_in_fan_out", "rank_pattern", "alpha_pattern"):
        if config.get(key):  # each changes the update away from one alpha / r B A per layer
            raise RequestError(
                f"lora_path: {path}: {key}={config[key]!r} is not served (plain LoRA: W + alpha / r B A)"
            )
    if config.get("modules_to_save"):
        raise RequestError(f"lora_path: {path}: modules_to_save {config['modules_to_save']} are not served")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise RequestError(f"lora_path: {path}: adapter_config.json needs r >= 1 and lora_alpha, got r={rank!r}")
    params = dict(model.named_parameters())
    pairs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key, a in tensors.items():
        if not key.endswith(".lora_A.weight"):
            if not key.endswith(".lora_B.weight"):
                raise RequestError(f"lora_path: {path}: unexpected tensor {key!r} in {WEIGHTS_FILE}")
            continue
        module = key.removeprefix(PREFIX)[: -len(".lora_A.weight")]
        b = tensors.get(f"{PREFIX}{module}.lora_B.weight")
        weight = params.get(f"{module}.weight")
        if b is None or weight is None:
            raise RequestError(f"lora_path: {path}: {module!r} has no lora_B or is no layer of the served model")
        if a.shape != (rank, weight.shape[1]) or b.shape != (weight.shape[0], rank):
            raise RequestError(
                f"lora_path: {path}: {module}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the weight "
                f"{tuple(weight.shape)} at rank {rank}"
            )
        pairs[f"{module}.weight"] = (a, b)
    if not pairs or len(pairs) * 2 != len(tensors):
        raise RequestError(f"lora_path: {path}: {len(tensors)} tensors do not pair into lora_A / lora_B")
    return Adapter(name, str(path), alpha / rank, pairs)


@dataclass
class AdapterSlot:
    """The adapter requests queued now will run with (``queued``: updates apply in queue order), the one
    merged into the weights now (``loaded``), and the base weights its merge replaced."""

    queued: Adapter | None = None
    loaded: Adapter | None = None
    base: dict[str, torch.Tensor] = field(default_factory=dict)

    def listing(self) -> dict[str, str]:
        """SGLang's ``loaded_adapters``: name -> path."""
        return {self.loaded.name: self.loaded.path} if self.loaded else {}

    def queue_load(self, adapter: Adapter) -> None:
        if self.queued is not None and self.queued.name == adapter.name:
            raise RequestError(f"lora_name: failed to load LoRA adapter {adapter.name!r} because it is already loaded")
        if self.queued is not None:
            raise RequestError(
                f"lora_name: this engine serves one adapter, merged into its weights, and {self.queued.name!r} is "
                "loaded: unload it first"
            )
        self.queued = adapter

    def queue_unload(self, name: str) -> None:
        if self.queued is None or self.queued.name != name:
            loaded = [self.queued.name] if self.queued else []
            raise RequestError(f"lora_name: no adapter {name!r} is loaded (loaded: {loaded})")
        self.queued = None

    def check_request(self, lora_path: str | None) -> None:
        """A request's ``lora_path`` against the weights it will run with."""
        adapter = self.queued
        if lora_path is None and adapter is not None:
            raise RequestError(
                f"lora_path: the engine runs adapter {adapter.name!r} merged into its weights; name it, or unload "
                "it to serve the base model"
            )
        if lora_path is not None and (adapter is None or lora_path not in (adapter.name, adapter.path)):
            loaded = [adapter.name] if adapter else []
            raise RequestError(f"lora_path: {lora_path!r} is not loaded (loaded: {loaded})")

    def merged(self, adapter: Adapter, model) -> dict[str, torch.Tensor]:
        """The weights to copy into ``model`` for ``adapter``, when its load applies (the base kept for unload)."""
        params = dict(model.named_parameters())
        self.base = {name: params[name].detach().clone() for name in adapter.pairs}
        self.loaded = adapter
        return {name: merge_weight(self.base[name], a, b, adapter.scaling) for name, (a, b) in adapter.pairs.items()}

    def restored(self) -> dict[str, torch.Tensor]:
        """The base weights to copy back, when the unload applies."""
        base, self.loaded, self.base = self.base, None, {}
        return base
