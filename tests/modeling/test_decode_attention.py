"""The engine's CPU decode-attention kernel (modeling/decode_attention.py): sdpa's answer within rounding, a row's
bits whatever shares its call, the calls it leaves to sdpa, and what happens where it cannot run."""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from support_replay.engine import Engine, EngineSettings
from support_replay.errors import ConfigError
from support_replay.modeling import decode_attention as da

pytestmark = pytest.mark.float_bits  # compares this CPU's kernels; CI reruns it on AVX2 kernels


@pytest.fixture(scope="module")
def kernel():
    built, why = da.compiled()
    if built is None:
        pytest.skip(f"the decode-attention kernel cannot run here: {why}")
    return built.decode_attention


def case(rows, heads, kv_heads, width, dim, dtype, seed, pitch=3):
    """Queries as a model's view, keys and values as strided views of a longer cache, rows of unlike lengths."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 1, heads, dim, generator=g).to(dtype).transpose(1, 2)
    k, v = (torch.randn(rows, kv_heads, width + pitch, dim, generator=g).to(dtype)[:, :, :width] for _ in range(2))
    lengths = torch.randint(1, width + 1, (rows, 1), generator=g)
    return q, k, v, torch.arange(width)[None] < lengths


def additive(seen, dtype=torch.float32):
    return torch.zeros(seen.shape, dtype=dtype).masked_fill(~seen, float("-inf"))[:, None, None]


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 6),
    kv_heads=st.integers(1, 3),
    group=st.integers(1, 4),
    width=st.integers(1, 70),
    dim=st.sampled_from([8, 16, 40, 64, 80, 128]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    mask_kind=st.sampled_from(["bool", "additive", "none"]),
    seed=st.integers(0, 2**16),
)
def test_the_kernel_is_sdpa_within_rounding(kernel, rows, kv_heads, group, width, dim, dtype, mask_kind, seed):
    q, k, v, seen = case(rows, kv_heads * group, kv_heads, width, dim, dtype, seed)
    mask = {"bool": seen[:, None, None], "additive": additive(seen, dtype), "none": None}[mask_kind]
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=dim**-0.5, enable_gqa=True)
    got = kernel(q, k, v, mask, dim**-0.5)
    assert got.shape == (rows, 1, kv_heads * group, dim) and got.dtype == dtype
    torch.testing.assert_close(
        got.float(),
        want.transpose(1, 2).float(),
        **{
            torch.float32: dict(atol=2e-6, rtol=1e-5),
            torch.bfloat16: dict(atol=1e-2, rtol=1e-2),
        }[dtype],
    )


def test_a_per_head_mask_is_taken_per_head(kernel):
    q, k, v, seen = case(3, 6, 2, 20, 16, torch.float32, 1)
    per_head = seen[:, None, None].expand(3, 6, 1, 20).clone()
    per_head[:, ::2, :, :5] = False  # every other query head sees fewer keys
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=per_head, enable_gqa=True)
    torch.testing.assert_close(kernel(q, k, v, per_head, 16**-0.5), want.transpose(1, 2), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_do_not_depend_on_the_other_rows_the_padding_or_the_threads(kernel, dtype):
    """The fused step attends rows in groups at their own widths, the module tree at the batch's width with
    left padding: a row must come out the same either way."""
    q, k, v, seen = case(5, 9, 3, 48, 64, dtype, 2)
    together = kernel(q, k, v, additive(seen, dtype), 0.125)
    threads = torch.get_num_threads()
    for row in range(5):
        n = int(seen[row].sum())
        alone = kernel(q[row : row + 1], k[row : row + 1, :, :n], v[row : row + 1, :, :n], None, 0.125)
        assert torch.equal(alone, together[row : row + 1])
        shift = 7  # the same keys behind left padding, in a wider call: a boolean mask this time
        pad_k = torch.cat([torch.randn(1, 3, shift, 64).to(dtype), k[row : row + 1, :, :n]], dim=2)
        pad_v = torch.cat([torch.randn(1, 3, shift, 64).to(dtype), v[row : row + 1, :, :n]], dim=2)
        left = (torch.arange(shift + n) >= shift)[None, None, None]
        assert torch.equal(kernel(q[row : row + 1], pad_k, pad_v, left, 0.125), together[row : row + 1])
    try:
        torch.set_num_threads(1)
        assert torch.equal(kernel(q, k, v, additive(seen, dtype), 0.125), together)
    finally:
        torch.set_num_threads(threads)


def test_shapes_it_cannot_take_are_refused_by_the_kernel_itself(kernel):
    q, k, v, seen = case(2, 4, 2, 10, 16, torch.float32, 3)
    with pytest.raises(RuntimeError, match="one query per row"):
        kernel(torch.randn(2, 4, 3, 16), k, v, None, 0.25)
    with pytest.raises(RuntimeError, match="4 query heads over 3 key-value heads"):
        kernel(q, torch.randn(2, 3, 10, 16), torch.randn(2, 3, 10, 16), None, 0.25)
    with pytest.raises(RuntimeError, match="does not broadcast"):
        kernel(q, k, v, seen[:, None, None, :9], 0.25)
    with pytest.raises(RuntimeError, match="contiguous head dims"):
        kernel(q, k.transpose(2, 3).contiguous().transpose(2, 3), v, None, 0.25)


class _Module(torch.nn.Module):
    num_key_value_groups = 2
    is_causal = True


def test_the_attention_function_leaves_other_calls_to_sdpa(kernel, monkeypatch):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    calls = []
    monkeypatch.setattr(da, "takes_kernel", lambda *a: calls.append(1) or False)
    q, k, v, seen = case(2, 4, 2, 10, 16, torch.float32, 4)
    out, _ = da.decode_attention_forward(_Module(), q, k, v, seen[:, None, None], scaling=0.25)
    want, _ = sdpa_attention_forward(_Module(), q, k, v, seen[:, None, None], scaling=0.25)
    assert calls and torch.equal(out, want)  # a call the kernel does not take is sdpa's, bit for bit
    monkeypatch.undo()

    prefill = torch.randn(2, 4, 5, 16)  # more than one query: sdpa
    assert not da.takes_kernel(prefill, k, v, None, 0.0, {})
    assert not da.takes_kernel(q, k, v, None, 0.1, {})  # dropout
    assert not da.takes_kernel(q, k, v, None, 0.0, {"sliding_window": 4})
    assert not da.takes_kernel(q.requires_grad_(), k, v, None, 0.0, {})  # a gradient wanted
    with torch.no_grad():
        assert da.takes_kernel(q, k, v, seen[:, None, None], 0.0, {"sliding_window": None})
    out, _ = da.decode_attention_forward(_Module(), q.detach(), k, v, seen[:, None, None], scaling=0.25)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)


def test_a_kernel_that_does_not_build_leaves_sdpa_or_is_refused_by_name(tiny_checkpoint, unbuildable_kernels):
    with unbuildable_kernels():
        built, why = da.compiled()
        assert built is None and why.startswith("it did not build in ")
        model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
        with pytest.raises(ConfigError, match="decode_attention: 'kernel' cannot run here: it did not build"):
            da.use_decode_attention(model, "kernel")
        assert da.use_decode_attention(model, "auto") == "sdpa"
        assert model.config._attn_implementation == "sdpa"


def test_a_kernel_that_disagrees_with_sdpa_is_not_used(kernel):
    assert da.check(kernel) == ""
    wrong = lambda q, k, v, mask, scale: kernel(q, k, v, mask, scale) * 1.001  # noqa: E731
    assert da.check(wrong).startswith("it disagrees with sdpa by ")


def test_the_engine_takes_the_kernel_where_it_runs_and_says_so(tiny_checkpoint, kernel):
    engine = Engine.from_pretrained(tiny_checkpoint)
    assert engine.decode_attention == "kernel"
    assert engine.runner.model.config._attn_implementation == da.ATTENTION
    assert Engine.from_pretrained(tiny_checkpoint, EngineSettings(decode_attention="sdpa")).decode_attention == "sdpa"
    assert (
        Engine.from_pretrained(tiny_checkpoint, EngineSettings(deterministic=True)).decode_attention
        == "batch-invariant"
    )
    # the deterministic engine attends every query through this kernel's arithmetic already
    assert Engine.from_pretrained(
        tiny_checkpoint, EngineSettings(deterministic=True, decode_attention="kernel")
    ).decode_attention == ("batch-invariant")
    with pytest.raises(ConfigError, match="decode_attention: 'flash' is not one of"):
        Engine.from_pretrained(tiny_checkpoint, EngineSettings(decode_attention="flash"))


def test_a_model_on_another_attention_keeps_it(tiny_checkpoint, kernel):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32, attn_implementation="eager")
    assert da.use_decode_attention(model, "auto") == "eager"
    with pytest.raises(ConfigError, match="'kernel' needs a model on sdpa attention, this one is on 'eager'"):
        da.use_decode_attention(model, "kernel")


def test_sdpa_asked_for_puts_a_model_on_the_kernel_back_on_sdpa(tiny_checkpoint, kernel):
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    assert da.use_decode_attention(model, "auto") == "kernel"
    assert da.use_decode_attention(model, "sdpa") == "sdpa"
    assert model.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_rows_shared_positions_are_read_from_the_row_it_names_with_the_same_bits(kernel, dtype):
    """``shared`` [B, 2]: row b's first positions hold row ``shared[b, 0]``'s keys and values (a prompt prefilled once
    for a group of samples) and are read there; where that holds, the output is the one without it, bit for bit."""
    q, k, v, _ = case(5, 9, 3, 40, 64, dtype, 5)
    lengths = torch.tensor([30, 36, 25, 40, 33])
    prompt = 20
    for row in (1, 3):  # rows 1 and 3 copy row 0's prompt; row 4 copies row 2's
        k[row, :, :prompt], v[row, :, :prompt] = k[0, :, :prompt], v[0, :, :prompt]
    k[4, :, :prompt], v[4, :, :prompt] = k[2, :, :prompt], v[2, :, :prompt]
    mask = additive(torch.arange(40)[None] < lengths[:, None], dtype)
    shared = torch.tensor([[0, 0], [0, prompt], [2, 0], [0, prompt], [2, prompt]])
    want = kernel(q, k, v, mask, 0.125)
    assert torch.equal(kernel(q, k, v, mask, 0.125, shared), want)
    # the row's own copy is not read: spoiled, the output is still the shared one's
    spoiled_k, spoiled_v = k.clone(), v.clone()
    for row in (1, 3, 4):
        spoiled_k[row, :, :prompt] = float("nan")
        spoiled_v[row, :, :prompt] = float("nan")
    assert torch.equal(kernel(q, spoiled_k, spoiled_v, mask, 0.125, shared), want)
    assert kernel(q, spoiled_k, spoiled_v, mask, 0.125).isnan().any()


def test_a_shared_table_that_does_not_fit_is_refused(kernel):
    q, k, v, seen = case(3, 4, 2, 10, 16, torch.float32, 6)
    with pytest.raises(RuntimeError, match=r"shared must be int64 \[3, 2\]"):
        kernel(q, k, v, None, 0.25, torch.zeros(3, 2, dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"shared must be int64 \[3, 2\]"):
        kernel(q, k, v, None, 0.25, torch.zeros(2, 2, dtype=torch.long))
    with pytest.raises(RuntimeError, match="row 1 shares 4 positions of row 3"):
        kernel(q, k, v, None, 0.25, torch.tensor([[0, 0], [3, 4], [0, 0]]))
    with pytest.raises(RuntimeError, match="row 2 shares 11 positions of row 0"):
        kernel(q, k, v, None, 0.25, torch.tensor([[0, 0], [0, 4], [0, 11]]))
