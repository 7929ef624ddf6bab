"""Sparse upcycling: with no perturbation the Mixtral-shaped model computes the dense model's function."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from support_replay.errors import ConfigError
from support_replay.modeling.moe import routing_shape
from support_replay.modeling.upcycle import upcycle, upcycled_checkpoint


def test_an_unperturbed_upcycle_is_the_dense_model(tmp_path):
    from tiny_model import build_tiny_checkpoint

    dense_path = build_tiny_checkpoint(tmp_path / "llama", llama_tied=True)
    dense = AutoModelForCausalLM.from_pretrained(dense_path, dtype=torch.float32).eval()
    ids = torch.randint(0, 300, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = dense(ids).logits
        same = upcycle(dense, experts=4, top_k=2, noise=0.0)(ids).logits
        perturbed = upcycle(dense, experts=4, top_k=2, noise=0.3)(ids).logits
    torch.testing.assert_close(same, reference, rtol=1e-5, atol=1e-5)  # two halves of one MLP, summed
    assert (perturbed - reference).abs().max() > 1e-3
    saved = upcycled_checkpoint(dense_path, tmp_path / "moe", experts=4, top_k=2, noise=0.0)
    shape = routing_shape(AutoModelForCausalLM.from_pretrained(saved))
    assert (shape.num_experts, shape.top_k, shape.layers) == (4, 2, 2)


def test_only_a_bias_free_llama_is_upcycled(tiny_checkpoint):
    with pytest.raises(ConfigError, match="a bias-free Llama checkpoint is expected, got qwen3"):
        upcycle(AutoModelForCausalLM.from_pretrained(tiny_checkpoint))
