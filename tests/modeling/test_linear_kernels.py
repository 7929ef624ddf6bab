"""The engine's linear kernels: oneDNN's fp32 product, its autograd, and the bit-level facts
the batch-invariant forward and the union head rest on (modeling/linear_kernels.py)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from support_replay.core.logprobs import support_logprobs, union_head_support_logprobs
from support_replay.engine import Engine
from support_replay.errors import ConfigError
from support_replay.modeling import linear_kernels
from support_replay.modeling.invariant_products import cpu_name, invariant_linear, invariant_plan
from support_replay.modeling.linear_kernels import (
    linear_function,
    model_linear,
    onednn_available,
    resolve_linear_kernel,
    use_linear,
)

pytestmark = pytest.mark.float_bits  # bit-level facts of this CPU's kernels: CI reruns them on AVX2 kernels

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


def _plan_or_skip(kernel, shape, dtype=torch.float32):
    if kernel == "onednn" and not onednn_available():
        pytest.skip("this PyTorch has no oneDNN linear op")
    plan = invariant_plan(kernel, *shape, dtype, torch.get_num_threads())
    if plan is None:  # the refusal itself is tested in tests/modeling/test_invariant_products.py
        pytest.skip(f"no batch-invariant {kernel} product for {shape} on this CPU ({cpu_name()})")
    return plan


@pytest.mark.float_bits
@pytest.mark.parametrize("kernel", ["onednn", "torch"])
@pytest.mark.parametrize("shape", [(200, 96), (960, 576), (576, 1536)])
def test_the_probed_plan_keeps_row_bits_on_other_data(threads, kernel, shape):
    # the probe ran on its own random data and counts; here other data, more counts, longer products
    _plan_or_skip(kernel, shape)
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(*shape, generator=gen)
    many = torch.randn(640, shape[1], generator=gen)
    product = invariant_linear(kernel)
    reference = product(many, w)
    for count in list(range(1, 34)) + [63, 100, 257, 600]:
        for at in (0, 5, 640 - count):
            assert torch.equal(product(many[at : at + count], w), reference[at : at + count]), (count, at)


@pytest.mark.float_bits
@pytest.mark.parametrize("kernel", ["onednn", "torch"])
def test_union_head_equals_the_full_head_where_the_probe_says_columns_keep_their_bits(threads, kernel):
    gen = torch.Generator().manual_seed(2)
    vocab, hidden = 3000, 64
    plan = _plan_or_skip(kernel, (vocab, hidden))
    if not plan.columns:  # the trainer scores through the full head then (tests/modeling/test_invariant_products.py)
        pytest.skip(f"{kernel}: a column subset takes other bits on this CPU ({cpu_name()})")
    w = torch.randn(vocab, hidden, generator=gen)
    h = torch.randn(37, hidden, generator=gen)
    ids = [
        torch.randperm(vocab, generator=gen)[: int(n)].sort().values for n in torch.randint(1, 40, (37,), generator=gen)
    ]
    targets = torch.stack([row[0] for row in ids])
    width = max(len(r) for r in ids)
    padded_ids = torch.stack([F.pad(r, (0, width - len(r))) for r in ids])
    valid = torch.stack([torch.arange(width) < len(r) for r in ids])
    product = invariant_linear(kernel)
    full = support_logprobs(product(h, w), targets, (padded_ids, valid))
    union = union_head_support_logprobs(h, w, targets, (padded_ids, valid), linear=product)
    assert torch.equal(union, full)


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
