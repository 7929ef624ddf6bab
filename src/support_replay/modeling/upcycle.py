"""Sparse upcycling: a dense Llama-shaped checkpoint made into a Mixtral-shaped mixture of experts.

Every expert starts as a copy of the layer's dense MLP plus a small perturbation (``noise`` times
the weight's own standard deviation), and the router is drawn small (``router_std``), so several
experts are near-tied for most tokens: the regime where a last-bit difference between engine and
trainer flips the routing. With ``noise=0`` every expert is the dense MLP and the top-k weights sum
to one, so the model computes the dense model's function (up to rounding). No MoE weights can be
downloaded here; this is how the benchmarks get a real-sized, real-text MoE (bench/moe_replay.py).
"""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, MixtralConfig, MixtralForCausalLM

from ..errors import ConfigError


def mixtral_config_from_llama(dense, experts: int, top_k: int) -> MixtralConfig:
    cfg = dense.config
    if cfg.model_type != "llama" or getattr(cfg, "mlp_bias", False) or getattr(cfg, "attention_bias", False):
        raise ConfigError(f"upcycle: a bias-free Llama checkpoint is expected, got {cfg.model_type}")
    return MixtralConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=getattr(cfg, "head_dim", None),
        hidden_act=cfg.hidden_act,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_parameters=dict(cfg.rope_parameters),
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
        num_local_experts=experts,
        num_experts_per_tok=top_k,
        sliding_window=None,
        router_jitter_noise=0.0,
    )


@torch.no_grad()
def upcycle(dense, experts: int = 4, top_k: int = 2, noise: float = 0.02, router_std: float = 0.02, seed: int = 0):
    """The Mixtral-shaped model of ``dense`` (a loaded Llama causal LM), fp32."""
    gen = torch.Generator().manual_seed(seed)
    model = MixtralForCausalLM(mixtral_config_from_llama(dense, experts, top_k)).float()
    source = dense.state_dict()
    target = model.state_dict()
    for name, value in source.items():
        if ".mlp." not in name and name in target:
            target[name].copy_(value)
    for i, layer in enumerate(model.model.layers):
        mlp = dense.model.layers[i].mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # [2I, H]: gate first (chunk(2))
        down = mlp.down_proj.weight  # [H, I]
        for e in range(experts):
            layer.mlp.experts.gate_up_proj[e] = gate_up + noise * gate_up.std() * torch.randn(
                gate_up.shape, generator=gen
            )
            layer.mlp.experts.down_proj[e] = down + noise * down.std() * torch.randn(down.shape, generator=gen)
        layer.mlp.gate.weight.copy_(router_std * torch.randn(layer.mlp.gate.weight.shape, generator=gen))
    if model.config.tie_word_embeddings:
        model.tie_weights()
    return model.eval()


def upcycled_checkpoint(dense_path: Path, target: Path, **settings) -> Path:
    """``upcycle`` of the checkpoint at ``dense_path`` saved at ``target`` once (written beside it, then moved)."""
    target = Path(target)
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    from .checkpoints import save_checkpoint

    dense = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32)
    return save_checkpoint(upcycle(dense, **settings), AutoTokenizer.from_pretrained(dense_path), target)
