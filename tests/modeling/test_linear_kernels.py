"""The engine's linear kernels outside true-on-policy mode: oneDNN's fp32 product, its autograd, the choice of
``auto`` and how a model routes its linear layers (modeling/linear_kernels.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support_replay.engine import Engine
from support_replay.errors import ConfigError
from support_replay.modeling import linear_kernels
from support_replay.modeling.linear_kernels import (
    linear_function,
    model_linear,
    onednn_available,
    resolve_linear_kernel,
    use_linear,
)

needs_onednn = pytest.mark.skipif(not onednn_available(), reason="this PyTorch has no oneDNN linear op")


def test_auto_picks_the_probed_product_for_fp32_on_a_cpu_only():
    from support_replay.modeling.kernel_probe import probed_kernel

    probed = probed_kernel() if onednn_available() else "torch"
    assert resolve_linear_kernel("auto", torch.float32, "cpu") == probed
    assert resolve_linear_kernel("auto", torch.bfloat16, "cpu") == "torch"
    assert resolve_linear_kernel("torch", torch.float32, "cpu") == "torch"
    with pytest.raises(ConfigError, match="linear_kernel: 'onednn' runs fp32 on a CPU .* torch.bfloat16 on cpu"):
        resolve_linear_kernel("onednn", torch.bfloat16, "cpu")
    with pytest.raises(ConfigError, match="linear_kernel: 'mkl' is not one of"):
        resolve_linear_kernel("mkl", torch.float32, "cpu")


@needs_onednn
def test_onednn_product_and_its_gradients_match_f_linear():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 48, generator=gen, requires_grad=True)
    w = torch.randn(40, 48, generator=gen, requires_grad=True)
    b = torch.randn(40, generator=gen, requires_grad=True)
    upstream = torch.randn(3, 5, 40, generator=gen)
    ours = linear_function("onednn")(x, w, b)
    grads = torch.autograd.grad((ours * upstream).sum(), (x, w, b))
    ref = F.linear(x, w, b)
    ref_grads = torch.autograd.grad((ref * upstream).sum(), (x, w, b))
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
    with torch.no_grad():  # no graph: the op alone
        assert not linear_function("onednn")(x, w, b).requires_grad


def test_use_linear_routes_every_linear_and_changes_no_parameter():
    model = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 4, bias=False))
    calls = []

    def counting(x, weight, bias=None):
        calls.append(tuple(weight.shape))
        return F.linear(x, weight, bias)

    keys = list(model.state_dict())
    x = torch.randn(2, 8)
    before = model(x)
    use_linear(model, counting)
    assert torch.equal(model(x), before) and calls == [(6, 8), (4, 6)]
    assert list(model.state_dict()) == keys and model_linear(model) is counting
    assert model_linear(nn.Linear(2, 2)) is F.linear


def test_bf16_on_a_cpu_without_bf16_instructions_is_named_slow(tiny_checkpoint, monkeypatch, caplog):
    monkeypatch.setattr(linear_kernels, "bf16_instructions", lambda: False)
    why = linear_kernels.slow_bf16(torch.bfloat16, "cpu")
    assert why.startswith("this CPU has no bf16 instructions, so PyTorch's bf16 products run its portable GEMM")
    assert linear_kernels.slow_bf16(torch.float32, "cpu") is None
    assert linear_kernels.slow_bf16(torch.bfloat16, "cuda") is None
    with caplog.at_level("WARNING", logger="support_replay.engine.engine"):
        Engine.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16)
    assert f"engine in bfloat16: {why}" in caplog.text
    monkeypatch.setattr(linear_kernels, "bf16_instructions", lambda: True)
    assert linear_kernels.slow_bf16(torch.bfloat16, "cpu") is None
