import math

import pytest
import torch
from bf16_gradients import assert_rounded_once, exact_support_grad

from support_replay import (
    SupportError,
    SupportTable,
    entropy,
    full_logprobs,
    full_logprobs_and_entropy,
    sparse_head_support_logprobs,
    support_logprobs,
)
from support_replay.core.logprobs import CPU_CHUNK_BYTES, DEFAULT_CHUNK_ROWS, chunk_rows_for

pytestmark = pytest.mark.float_bits  # bit-level facts of this CPU's kernels: CI reruns them on AVX2 kernels


def make_case(rows=37, vocab=53, seed=0, max_k=None):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 3
    lists = []
    for t in range(rows):
        kind = t % 4
        if kind == 0:
            size = 1
        elif kind == 1:
            size = vocab  # the whole vocabulary
        else:
            size = int(torch.randint(2, max_k or vocab, (1,), generator=g))
        lists.append(torch.randperm(vocab, generator=g)[:size].tolist())
    targets = torch.tensor([r[int(torch.randint(0, len(r), (1,), generator=g))] for r in lists])
    return logits, targets, SupportTable.from_lists(lists)


def dense_reference(logits64, targets, table, temperature):
    mask = torch.zeros_like(logits64, dtype=torch.bool)
    for t, row in enumerate(table.to_lists()):
        mask[t, row] = True
    logp = torch.log_softmax((logits64 / temperature).masked_fill(~mask, -math.inf), dim=-1)
    return logp.gather(1, targets[:, None]).squeeze(1)


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_support_logprobs_matches_float64_dense_reference(temperature):
    logits64, targets, table = make_case()
    logits = logits64.float().requires_grad_()
    out = support_logprobs(logits, targets, table, temperature)
    ref_in = logits.detach().double().requires_grad_()  # the same fp32 values, exact math
    ref = dense_reference(ref_in, targets, table, temperature)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=1e-6, rtol=1e-6)
    w = torch.randn(len(targets), dtype=torch.float64, generator=torch.Generator().manual_seed(11))
    (out.double() * w).sum().backward()
    (ref * w).sum().backward()
    torch.testing.assert_close(logits.grad.double(), ref_in.grad, atol=1e-6, rtol=0)
    # gradient vanishes off the support
    off = torch.ones_like(logits, dtype=torch.bool)
    for t, row in enumerate(table.to_lists()):
        off[t, row] = False
    assert bool((logits.grad[off] == 0).all())


def test_singleton_rows_are_exactly_zero():
    logits = torch.randn(5, 20)
    targets = torch.tensor([3, 1, 4, 1, 5])
    out = support_logprobs(logits, targets, SupportTable.singleton(targets), 0.9)
    assert out.tolist() == [0.0] * 5


def test_bf16_input_accumulates_in_fp32():
    logits64, targets, table = make_case(seed=1)
    bf = logits64.to(torch.bfloat16)
    out = support_logprobs(bf, targets, table, 1.0)
    ref = dense_reference(bf.double(), targets, table, 1.0)  # same (rounded) logits, exact math
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=0)
    bf.requires_grad_()
    support_logprobs(bf, targets, table, 1.0).sum().backward()
    assert bf.grad.dtype == torch.bfloat16


def test_bf16_gradients_are_the_exact_gradient_rounded_once():
    """Confident tokens (p_a > 0.99), supports of one id and of the whole vocabulary: each entry of the bf16
    gradient is the float64 gradient rounded once, so each row sums to zero within rounding (the target's entry
    was built from two bf16 pieces and cancelled to 0 for a confident token: 33 ulps off the exact value)."""
    z = torch.tensor([[8.0, 1.5, 0.0]], dtype=torch.bfloat16, requires_grad=True)
    support_logprobs(z, torch.tensor([0]), SupportTable.from_lists([[0, 1, 2]]), 1.0).sum().backward()
    assert_rounded_once(z.grad, exact_support_grad(z.detach(), torch.tensor([0]), [[0, 1, 2]], 1.0, [1.0]))
    assert float(z.grad[0, 0]) == pytest.approx(1.839e-3, rel=4e-3)
    gen = torch.Generator().manual_seed(9)
    rows, vocab = 64, 97
    logits = torch.randn(rows, vocab, generator=gen) * 3
    lists = []
    for t in range(rows):
        size = [1, 2, 5, vocab][t % 4]
        ids = torch.randperm(vocab, generator=gen)[:size].tolist()
        if t % 3 == 0:  # a confident token: p_a > 0.99 on its support
            logits[t, ids[0]] = logits[t, ids].max() + 12
        lists.append(ids)
    targets = torch.tensor([ids[0] for ids in lists])
    upstream = torch.randn(rows, generator=gen)
    for temperature in (1.0, 0.7):
        x = logits.to(torch.bfloat16).requires_grad_()
        (support_logprobs(x, targets, SupportTable.from_lists(lists), temperature) * upstream).sum().backward()
        assert_rounded_once(x.grad, exact_support_grad(x.detach(), targets, lists, temperature, upstream))


def test_per_row_temperature():
    logits64, targets, table = make_case(seed=2)
    temps = torch.linspace(0.5, 1.5, len(targets))
    out = support_logprobs(logits64.float(), targets, table, temps)
    for t in range(len(targets)):
        single = dense_reference(logits64[t : t + 1], targets[t : t + 1], table.select([t]), float(temps[t]))
        assert abs(float(out[t]) - float(single)) < 1e-6


def test_result_does_not_depend_on_padding_or_batch():
    logits64, targets, table = make_case(rows=40, seed=3, max_k=12)
    logits = logits64.float()
    full = support_logprobs(logits, targets, table, 0.8)
    ids, valid = table.to_padded(k=table.max_size() + 29)
    assert torch.equal(full, support_logprobs(logits, targets, (ids, valid), 0.8))
    for t in (0, 5, 17, 39):
        alone = support_logprobs(logits[t : t + 1], targets[t : t + 1], table.select([t]), 0.8)
        assert torch.equal(alone[0], full[t])


def test_support_logprobs_errors():
    logits = torch.zeros(2, 5)
    table = SupportTable.from_lists([[1], [2]])
    with pytest.raises(SupportError, match="temperature: must be > 0"):
        support_logprobs(logits, torch.tensor([1, 2]), table, 0.0)
    with pytest.raises(SupportError, match="2 logit rows, 1 support rows"):
        support_logprobs(logits, torch.tensor([1, 2]), table.prefix(1))
    with pytest.raises(SupportError, match="expected a scalar or 2 values"):
        support_logprobs(logits, torch.tensor([1, 2]), table, torch.ones(3))


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_full_logprobs_and_entropy_match_float64(temperature):
    logits64, targets, _ = make_case(seed=4)
    x = logits64.float().requires_grad_()
    lp, ent = full_logprobs_and_entropy(x, targets, temperature, chunk_rows=8)
    ref_in = x.detach().double().requires_grad_()
    ref_lp_all = torch.log_softmax(ref_in / temperature, -1)
    ref_lp = ref_lp_all.gather(1, targets[:, None]).squeeze(1)
    ref_ent = -(ref_lp_all.exp() * ref_lp_all).sum(-1)
    torch.testing.assert_close(lp.double(), ref_lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(ent.double(), ref_ent, atol=1e-5, rtol=0)
    g = torch.Generator().manual_seed(12)
    a, b = (
        torch.randn(len(targets), dtype=torch.float64, generator=g),
        torch.randn(len(targets), dtype=torch.float64, generator=g),
    )
    ((lp.double() * a).sum() + (ent.double() * b).sum()).backward()
    ((ref_lp * a).sum() + (ref_ent * b).sum()).backward()
    torch.testing.assert_close(x.grad.double(), ref_in.grad, atol=2e-5, rtol=2e-5)
    assert torch.equal(full_logprobs(logits64.float(), targets, temperature), lp.detach())
    assert torch.equal(entropy(logits64.float(), temperature), ent.detach())


def test_full_logprobs_alone_are_the_pair_s_log_probs_and_gradient_bit_for_bit():
    g = torch.Generator().manual_seed(5)
    rows, vocab = 2 * chunk_rows_for(torch.empty(1, 4099)) + 1, 4099  # two whole chunks and a lone row after them
    logits = (torch.randn(rows, vocab, generator=g) * 3).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), generator=g)
    temps = torch.rand(rows, generator=g) + 0.5
    pair = full_logprobs_and_entropy(logits, targets, temps)[0]
    alone = full_logprobs(logits, targets, temps)
    assert torch.equal(alone, pair)
    weights = torch.randn(rows, generator=g)
    (want,) = torch.autograd.grad((pair * weights).sum(), logits)
    (got,) = torch.autograd.grad((alone * weights).sum(), logits)
    assert torch.equal(got, want)


@pytest.mark.parametrize("rows", [2, 7, 43])
def test_a_row_s_full_log_prob_and_entropy_do_not_depend_on_where_the_chunks_cut(rows):
    g = torch.Generator().manual_seed(rows)
    logits = torch.randn(rows, 40_000, generator=g) * 3  # a row of over 32768 entries: ATen splits a lone one
    targets = torch.randint(0, 40_000, (rows,), generator=g)
    whole = full_logprobs_and_entropy(logits, targets, 0.8, chunk_rows=rows)
    for chunk in (2, 3, 6, None):  # 7 = 2 + 2 + 3 and 43 = 14 x 3 + 1: a lone last row joins the chunk before it
        got = full_logprobs_and_entropy(logits, targets, 0.8, chunk_rows=chunk)
        assert torch.equal(got[0], whole[0]) and torch.equal(got[1], whole[1]), chunk


def test_the_cpu_chunk_holds_a_few_mib_of_rows():
    assert chunk_rows_for(torch.empty(1, 49152)) == CPU_CHUNK_BYTES // (49152 * 4)
    assert chunk_rows_for(torch.empty(1, 49152, dtype=torch.float64)) == CPU_CHUNK_BYTES // (49152 * 8)
    assert chunk_rows_for(torch.empty(1, 49152, dtype=torch.bfloat16)) == CPU_CHUNK_BYTES // (49152 * 4)  # fp32 temps
    assert chunk_rows_for(torch.empty(1, 10**7)) == 2  # never a lone row
    assert chunk_rows_for(torch.empty(1, 8)) == DEFAULT_CHUNK_ROWS


def test_a_chunk_of_no_rows_is_refused_by_name():
    with pytest.raises(SupportError, match="chunk_rows: must be at least 1, got 0"):
        full_logprobs(torch.zeros(2, 5), torch.tensor([1, 2]), chunk_rows=0)


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_sparse_head_equals_full_head(dtype, atol):
    g = torch.Generator().manual_seed(5)
    rows, hid, vocab = 29, 16, 71
    hidden = torch.randn(rows, hid, generator=g, dtype=dtype, requires_grad=True)
    weight = torch.randn(vocab, hid, generator=g, dtype=dtype, requires_grad=True)
    _, targets, table = make_case(rows=rows, vocab=vocab, seed=6)
    out = sparse_head_support_logprobs(hidden, weight, targets, table, 0.9, chunk_size=7)
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    ref = support_logprobs(h2 @ w2.T, targets, table, 0.9)
    torch.testing.assert_close(out, ref, atol=atol, rtol=0)
    coef = torch.randn(rows, generator=g)
    (out * coef).sum().backward()
    (ref * coef).sum().backward()
    torch.testing.assert_close(hidden.grad, h2.grad, atol=atol, rtol=0)
    torch.testing.assert_close(weight.grad, w2.grad, atol=atol, rtol=0)


def test_sparse_head_rejects_target_outside_support():
    with pytest.raises(SupportError, match="row 1: target 3 is not in its support"):
        sparse_head_support_logprobs(
            torch.zeros(2, 4), torch.zeros(6, 4), torch.tensor([1, 3]), SupportTable.from_lists([[1], [2]])
        )


def test_top_full_logprobs_are_the_float64_top_k_with_the_full_logprobs_bits():
    from support_replay.core.logprobs import top_full_logprobs

    g = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 300, generator=g) * 3
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 2.0, 0.5])
    values, ids = top_full_logprobs(logits, 7, temps)
    ref = torch.log_softmax(logits.double() / temps[:, None].double(), dim=-1)
    top = torch.topk(ref, 7, dim=-1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(values.double(), top.values, atol=1e-5, rtol=0)
    own = full_logprobs(logits, ids[:, 0], temps)  # the most likely id's entry: the bits of its own log-prob
    assert torch.equal(values[:, 0], own)
    with pytest.raises(SupportError, match="k=0"):
        top_full_logprobs(logits, 0)
