"""True-on-policy mode's arithmetic (kernels/invariant.py): each element follows the order the code states, whatever
the rows, columns, strides, threads or callers; the gradients are the operations' own.

The order is checked against tests/kernels/invariant_reference.py, which writes it out with exact roundings; the
invariances are checked where a vendor library's product is known to move (row counts from 1 to 257 at several
offsets, column subsets and fused weights, 1 and 2 threads). CI runs these under all three of ATen's kernel sets;
the build for each is this project's own, so they pass on every CPU."""

import pytest
import torch
import torch.nn.functional as F
from invariant_reference import dots as reference_dots
from invariant_reference import rms_norm as reference_rms_norm

from support_replay.kernels import invariant

pytestmark = pytest.mark.float_bits

K_SIZES = [1, 5, 16, 37, 64, 100, 130]  # whole vectors and partial ones, at W = 8 and 16
COUNTS = list(range(1, 34)) + [63, 64, 65, 100, 127, 128, 129, 200, 256, 257]


def _random(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("k_size", K_SIZES)
def test_every_element_is_the_stated_dot(k_size):
    x, w = _random(257, k_size, seed=k_size), _random(41, k_size, seed=k_size + 1)
    bias = _random(41, seed=3)
    want = reference_dots(x, w)
    assert torch.equal(invariant.linear(x, w), want)
    assert torch.equal(invariant.linear(x, w, bias), want + bias)  # the bias added once, after the dot
    xb, wb = x.bfloat16(), w.bfloat16()  # bf16 read as float32, the same arithmetic, the sum rounded once
    assert torch.equal(invariant.linear(xb, wb), reference_dots(xb, wb).bfloat16())


@pytest.mark.parametrize("shape", [(41, 37), (200, 96), (960, 576), (576, 1536)])
def test_a_rows_bits_do_not_depend_on_the_row_count_or_its_place(threads, shape):
    """What the old start-up probe asked of a vendor's product (row counts 1 to 257 cut at three offsets out of a
    longer product), asked of ours: always yes."""
    w = _random(*shape, seed=1)
    many = _random(320, shape[1], seed=2)
    whole = invariant.linear(many, w)
    for count in COUNTS:
        for at in {0, 7, 320 - count}:
            assert torch.equal(invariant.linear(many[at : at + count], w), whole[at : at + count]), (count, at)
    assert torch.equal(invariant.linear(many[None, :16].expand(3, 16, -1), w)[2], whole[:16])  # leading dims


def test_the_thread_count_changes_no_bit():
    x, w = _random(300, 200, seed=4), _random(500, 200, seed=5)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = invariant.linear(x, w)
        torch.set_num_threads(2)
        assert torch.equal(invariant.linear(x, w), one)
    finally:
        torch.set_num_threads(saved)


def test_a_columns_bits_do_not_depend_on_the_columns_beside_it(threads):
    x, w = _random(37, 64, seed=6), _random(333, 64, seed=7)
    full = invariant.linear(x, w)
    gen = torch.Generator().manual_seed(8)
    for count in (1, 3, 15, 16, 17, 100, 333):
        columns = torch.randperm(333, generator=gen)[:count]
        assert torch.equal(invariant.linear(x, w[columns]), full[:, columns])  # a subset, in any order
    parts = [w[:100], w[100:140], w[140:]]  # a fused QKV-like weight against its parts
    apart = torch.cat([invariant.linear(x, p) for p in parts], -1)
    assert torch.equal(apart, full)


def test_strided_rows_and_weights_give_the_contiguous_bits():
    wide, w_wide = _random(50, 150, seed=9), _random(40, 170, seed=10)
    x, w = wide[:, 10:110], w_wide[:, 20:120]  # rows apart by more than their length
    assert torch.equal(invariant.linear(x, w), invariant.linear(x.contiguous(), w.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_sparse_heads_dots_are_the_full_products_elements(threads, dtype):
    x, w = _random(64, 96, seed=11, dtype=dtype), _random(500, 96, seed=12, dtype=dtype)
    full = invariant.linear(x, w)
    gen = torch.Generator().manual_seed(13)
    counts = torch.randint(1, 20, (64,), generator=gen)
    ids = torch.randint(0, 500, (64, 19), generator=gen)
    valid = torch.arange(19)[None] < counts[:, None]
    got = invariant.dots(x, w, ids, valid)
    for t in range(64):
        n = int(counts[t])
        assert torch.equal(got[t, :n], full[t, ids[t, :n]]) and not got[t, n:].any()
    with pytest.raises(ValueError, match="valid ids must come first"):
        invariant.dots(x, w, ids, valid.flip(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [1, 7, 16, 64, 576, 1000])
def test_rms_norm_is_the_stated_order_and_row_by_row(threads, dtype, width):
    x, weight = (_random(33, width, seed=14) * 3).to(dtype), _random(width, seed=15).to(dtype)
    out = invariant.rms_norm(x, weight, 1e-6)
    assert torch.equal(out, reference_rms_norm(x, weight, 1e-6))
    for r in (0, 5, 32):
        assert torch.equal(invariant.rms_norm(x[r : r + 1], weight, 1e-6), out[r : r + 1])
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    norm = Qwen3RMSNorm(width, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), norm(x).float(), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_gives_an_element_the_same_bits_wherever_it_sits(dtype):
    """ATen's SiLU takes a scalar path for the elements past its last whole vector, with other bits: the same value
    then rounds differently with the tensor's length. Ours is one function for every element."""
    gate, up = (_random(4099, seed=16) * 5).to(dtype), _random(4099, seed=17).to(dtype)
    whole = invariant.silu_mul(gate, up)
    for n in list(range(1, 70)) + [1000, 4097]:
        assert torch.equal(invariant.silu_mul(gate[:n], up[:n]), whole[:n]), n
        assert torch.equal(invariant.silu_mul(gate[-n:], up[-n:]), whole[-n:]), n
    assert torch.equal(invariant.silu_mul(gate.reshape(1, 4099), up.reshape(1, 4099))[0], whole)
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(whole.float(), (F.silu(gate) * up).float(), rtol=tolerance, atol=tolerance)


def test_softmax_rows_keep_their_bits_and_are_softmax():
    x = _random(300, 24, seed=18) * 4
    out = invariant.softmax(x)
    for r in (0, 3, 299):
        assert torch.equal(invariant.softmax(x[r : r + 1]), out[r : r + 1])
    torch.testing.assert_close(out, torch.softmax(x, -1), rtol=1e-6, atol=1e-7)
    assert torch.equal(invariant.softmax(x.bfloat16()), invariant.softmax(x.bfloat16().float()))


def test_rotary_angles_do_not_depend_on_the_positions_beside_them():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = Qwen3Config(hidden_size=64, num_attention_heads=2, head_dim=32, max_position_embeddings=4096)
    rotary = Qwen3RotaryEmbedding(config)
    positions = torch.arange(3000).reshape(3, 1000)
    cos, sin = invariant.rotary(rotary.inv_freq, positions, rotary.attention_scaling)
    for row, start, n in ((0, 0, 1), (1, 17, 5), (2, 900, 100)):
        c, s = invariant.rotary(rotary.inv_freq, positions[row, start : start + n], rotary.attention_scaling)
        assert torch.equal(c, cos[row, start : start + n]) and torch.equal(s, sin[row, start : start + n])
    want_cos, want_sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    torch.testing.assert_close(cos, want_cos, rtol=0, atol=1e-6)
    torch.testing.assert_close(sin, want_sin, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_query_position_is_the_decode_kernels_answer_for_it_alone(threads, dtype):
    heads, kv_heads, dim, length = 6, 2, 48, 40
    q = _random(2, heads, length, dim, seed=19, dtype=dtype)
    k, v = (
        _random(2, kv_heads, length, dim, seed=20, dtype=dtype),
        _random(2, kv_heads, length, dim, seed=21, dtype=dtype),
    )
    causal = torch.ones(length, length, dtype=torch.bool).tril()[None, None].repeat(2, 1, 1, 1)
    causal[1, :, :, 30:] = False
    out = invariant.attention(q, k, v, causal, 0.15)
    for b in range(2):
        for i in range(length):
            one = invariant.attention(
                q[b : b + 1, :, i : i + 1], k[b : b + 1], v[b : b + 1], causal[b : b + 1, :, i : i + 1], 0.15
            )
            assert torch.equal(one[0, 0], out[b, i]), (b, i)
    assert not out[1, :, :, :].isnan().any()


def _float64_gradients(function, reference, inputs):
    """The gradients of ``function`` (ours) and of ``reference`` (float64) for one random upstream gradient."""
    ours = [x.detach().clone().requires_grad_() for x in inputs]
    theirs = [x.detach().double().requires_grad_() for x in inputs]
    out = function(*ours)
    upstream = _random(*out.shape, seed=22)
    got = torch.autograd.grad((out.float() * upstream).sum(), ours)
    want = torch.autograd.grad((reference(*theirs) * upstream.double()).sum(), theirs)
    return got, want


@pytest.mark.parametrize("name", ["linear", "rms_norm", "silu_mul", "softmax", "attention"], ids=lambda name: name)
def test_gradients_are_the_operations_own(name):
    gen_inputs = {
        "linear": ([_random(9, 20, seed=23), _random(7, 20, seed=24), _random(7, seed=25)], invariant.linear, F.linear),
        "rms_norm": (
            [_random(9, 20, seed=26), _random(20, seed=27)],
            lambda x, w: invariant.rms_norm(x, w, 1e-6),
            lambda x, w: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)),
        ),
        "silu_mul": (
            [_random(9, 20, seed=28), _random(9, 20, seed=29)],
            invariant.silu_mul,
            lambda g, u: F.silu(g) * u,
        ),
        "softmax": ([_random(9, 20, seed=30)], invariant.softmax, lambda x: torch.softmax(x, -1)),
        "attention": (
            [_random(2, 4, 6, 16, seed=31), _random(2, 2, 6, 16, seed=32), _random(2, 2, 6, 16, seed=33)],
            lambda q, k, v: invariant.attention(q, k, v, torch.ones(6, 6, dtype=torch.bool).tril()[None, None], 0.25),
            lambda q, k, v: F.scaled_dot_product_attention(
                q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True, scale=0.25
            ).transpose(1, 2),
        ),
    }
    inputs, function, reference = gen_inputs[name]
    got, want = _float64_gradients(function, reference, inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, rtol=1e-4, atol=1e-5)
