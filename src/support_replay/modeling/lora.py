"""LoRA adapters on the trainer's model (``peft``'s layers, injected in place so the model keeps its class),
and the two forms of its weights: merged under the Hugging Face names (what engines, the lagged scorer and a
checkpoint's ``model.safetensors`` receive) and the adapter alone in peft's layout (``adapter_model.safetensors``
with ``adapter_config.json``, which ``peft.PeftModel.from_pretrained`` loads).

A LoRA layer computes ``W x + (alpha / r) B A x``; merged, ``(W + (alpha / r) B A) x``: the same function, whose
float rounding differs in the last bits (docs/training.md, "LoRA")."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError

ADAPTER = "default"  # peft's name of the one adapter


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    dropout: float
    target_modules: str  # "all-linear" or comma-separated module names

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def peft_config(self, base: str | None = None):
        from peft import LoraConfig

        targets = self.target_modules if self.target_modules == "all-linear" else self.target_modules.split(",")
        return LoraConfig(
            r=self.rank,
            lora_alpha=self.alpha,
            lora_dropout=self.dropout,
            target_modules=targets,
            base_model_name_or_path=base,
            task_type="CAUSAL_LM",
        )


def add_lora(hf: nn.Module, settings: LoraSettings) -> nn.Module:
    """LoRA layers on ``hf``'s target modules, in place; every other weight frozen."""
    try:
        from peft import inject_adapter_in_model
    except ImportError:
        raise ConfigError(
            "--lora-rank: the peft package is not installed (pip install 'support-replay[lora]')"
        ) from None

    inject_adapter_in_model(settings.peft_config(), hf)
    for name, param in hf.named_parameters():
        param.requires_grad_(is_adapter_key(name))
    return hf


def is_adapter_key(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def merge_weight(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """``W + scaling B A`` in fp32, in ``W``'s dtype: the one merge the trainer and an engine given the adapter
    alone both compute (the same bits from the same tensors)."""
    return (w.float() + scaling * (b.float() @ a.float())).to(w.dtype)


def merged_state(state: dict[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """The weights under the base model's names, each adapted layer's ``W + scaling B A``."""
    out = {}
    for key, value in state.items():
        if is_adapter_key(key):
            continue
        if key.endswith(".base_layer.weight"):
            prefix = key[: -len(".base_layer.weight")]
            a, b = state[f"{prefix}.lora_A.{ADAPTER}.weight"], state[f"{prefix}.lora_B.{ADAPTER}.weight"]
            out[f"{prefix}.weight"] = merge_weight(value, a, b, scaling)
        else:
            out[key.replace(".base_layer.", ".")] = value
    return out


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors under peft's saved names (``base_model.model.<module>.lora_A.weight``)."""
    return {
        "base_model.model." + key.replace(f".{ADAPTER}.", "."): value
        for key, value in state.items()
        if is_adapter_key(key)
    }


def from_adapter_state(saved: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``adapter_state``'s names back to the model's own."""
    out = {}
    for key, value in saved.items():
        name = key.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
        out[name] = value
    return out
