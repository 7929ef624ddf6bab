import math

import numpy as np
import pytest
import torch
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from support_replay import (
    SamplingParams,
    SamplingParamsError,
    SupportTable,
    sample_tokens,
    support_logprobs,
    support_mask,
)

pytestmark = pytest.mark.float_bits  # bit-level facts of this CPU's kernels: CI reruns them on AVX2 kernels


def random_cases(n_batches, rows=64, vocab=40, seed=0):
    """Logits with smooth values, exact ties (integer grid) and near-ties (one ulp apart)."""
    g = torch.Generator().manual_seed(seed)
    for b in range(n_batches):
        kind = b % 3
        if kind == 0:
            logits = torch.randn(rows, vocab, generator=g) * (0.5 + 3 * torch.rand(rows, 1, generator=g))
        elif kind == 1:
            logits = torch.randint(0, 5, (rows, vocab), generator=g).float() * 0.7
        else:
            logits = torch.randint(0, 6, (rows, vocab), generator=g).float() * 0.5
            bump = torch.rand(rows, vocab, generator=g) < 0.3
            logits = torch.where(bump, torch.nextafter(logits, torch.tensor(math.inf)), logits)
        params = [
            SamplingParams(
                temperature=float(np.random.default_rng(b * 1000 + r).choice([0.6, 1.0, 1.3])),
                top_k=int(np.random.default_rng(b * 1000 + r + 1).choice([-1, 1, 2, 5, 17, vocab])),
                top_p=float(np.random.default_rng(b * 1000 + r + 2).choice([1.0, 0.3, 0.5, 0.8, 0.95])),
                min_p=float(np.random.default_rng(b * 1000 + r + 3).choice([0.0, 0.05, 0.2, 0.5])),
            )
            for r in range(rows)
        ]
        yield logits, params


def hf_warpers(p: SamplingParams):
    warpers = [TemperatureLogitsWarper(p.temperature)]
    if p.top_k > 0:
        warpers.append(TopKLogitsWarper(p.top_k))
    if p.top_p < 1:
        warpers.append(TopPLogitsWarper(p.top_p))
    if p.min_p > 0:
        warpers.append(MinPLogitsWarper(p.min_p))
    return warpers


def test_hf_semantics_match_transformers_warpers():
    # transformers' top-p sort is not stable, so tie order can depend on the batch: compare
    # whole batches, each with one setting, exactly as the warpers would see them
    checked = 0
    for b, (logits, params) in enumerate(random_cases(60)):
        p = params[b % len(params)]
        mask = support_mask(logits, p, "hf")
        scores = logits.clone()
        for w in hf_warpers(p):
            scores = w(None, scores)
        assert torch.equal(mask, torch.isfinite(scores)), (b, p)
        checked += logits.shape[0]
    assert checked >= 3000


def sglang_reference(logits_row, p: SamplingParams):
    """SGLang's torch sampler (docs/math.md), written as plainly as possible, one row at a time."""
    probs = torch.softmax(logits_row.float() / p.temperature, dim=-1).numpy()
    order = sorted(range(len(probs)), key=lambda i: (-probs[i], i))
    k = p.top_k if p.top_k > 0 else len(probs)
    kept, mass = [], np.float32(0)
    for rank, i in enumerate(order):
        exclusive = mass
        mass = np.float32(mass + probs[i])
        if rank < k and (p.top_p >= 1 or exclusive <= np.float32(p.top_p)):
            kept.append(i)
    kept = [i for i in kept if probs[i] >= np.float32(p.min_p) * probs[order[0]] and probs[i] > 0]
    out = torch.zeros(len(probs), dtype=torch.bool)
    out[kept] = True
    return out


def vllm_reference(logits_row, p: SamplingParams):
    """vLLM (docs/math.md): temperature, min-p, top-k keeping ties, top-p on the renormalised rest."""
    y = (logits_row.float() / p.temperature).numpy()
    probs = np.exp(y.astype(np.float64) - y.max())
    probs /= probs.sum()
    alive = probs >= p.min_p * probs.max()
    if p.top_k > 0:
        kth = np.sort(y[alive])[::-1][min(p.top_k, alive.sum()) - 1]
        alive &= y >= kth
    if p.top_p < 1:
        q = np.where(alive, np.exp(y - y[alive].max()), 0.0).astype(np.float32)
        q /= q.sum()
        order = sorted(np.flatnonzero(alive), key=lambda i: (y[i], i))  # ascending logits, ties by lower id first
        cum = np.float32(0)
        for pos, i in enumerate(order):
            cum = np.float32(cum + np.float32(q[i]))
            if cum <= np.float32(1) - np.float32(p.top_p) and pos < len(order) - 1:
                alive[i] = False
    return torch.from_numpy(alive)


@pytest.mark.parametrize("semantics, reference", [("sglang", sglang_reference), ("vllm", vllm_reference)])
def test_engine_semantics_match_simple_reference(semantics, reference):
    for logits, params in random_cases(12, seed=7):
        mask = support_mask(logits, params, semantics)
        for r, p in enumerate(params):
            assert torch.equal(mask[r], reference(logits[r], p)), (semantics, r, p, logits[r])


def test_documented_differences_three_semantics_disagree():
    # top_k=4, top_p=0.6, min_p=0.22 on p = (.4, .15, .1, .08, 4 x .0675):
    # sglang judges top-p on the unfiltered mass   -> {0, 1, 2}
    # hf renormalises after top-k, min-p last       -> {0, 1}
    # vllm applies min-p first, then renormalises   -> {0}
    probs = torch.tensor([[0.4, 0.15, 0.1, 0.08, 0.0675, 0.0675, 0.0675, 0.0675]])
    params = SamplingParams(top_k=4, top_p=0.6, min_p=0.22)
    got = {s: support_mask(probs.log(), params, s)[0].nonzero().flatten().tolist() for s in ("sglang", "hf", "vllm")}
    assert got == {"sglang": [0, 1, 2], "hf": [0, 1], "vllm": [0]}


def test_ties_at_top_k_sglang_keeps_exactly_k_others_keep_ties():
    logits = torch.tensor([[3.0, 1.0, 2.0, 2.0, 2.0, 0.0]])
    params = SamplingParams(top_k=2)
    assert support_mask(logits, params, "sglang")[0].nonzero().flatten().tolist() == [0, 2]
    assert support_mask(logits, params, "vllm")[0].nonzero().flatten().tolist() == [0, 2, 3, 4]
    assert support_mask(logits, params, "hf")[0].nonzero().flatten().tolist() == [0, 2, 3, 4]


@pytest.mark.parametrize("semantics", ["sglang", "vllm", "hf"])
def test_sample_captures_support_and_logmu(semantics):
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(256, 100, generator=g) * 2
    params = SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.01)
    out = sample_tokens(logits, params, semantics, generator=g)
    mask = support_mask(logits, params, semantics)
    assert out.support == SupportTable.from_mask(mask)
    out.support.validate(100, selected=out.tokens)
    dense = torch.log_softmax((logits.double() / 0.8).masked_fill(~mask, -math.inf), -1)
    expected = dense.gather(1, out.tokens[:, None]).squeeze(1)
    torch.testing.assert_close(out.log_mu.double(), expected, atol=1e-6, rtol=0)
    # the trainer scores with the same function on the same logits: bit-identical
    assert torch.equal(out.log_mu, support_logprobs(logits, out.tokens, out.support, 0.8))


def test_sample_frequencies_follow_the_renormalised_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]]).repeat(20000, 1)
    params = SamplingParams(top_k=3)
    out = sample_tokens(logits, params, "sglang", generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(out.tokens, minlength=5).double() / 20000
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.5]).double(), -1)
    torch.testing.assert_close(freq[:3], expected, atol=0.015, rtol=0)
    assert freq[3:].sum() == 0


def test_per_row_generators_are_reproducible_and_independent_of_the_batch():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(top_p=0.9, top_k=30)
    gens = [torch.Generator().manual_seed(s) for s in (10, 11, 12, 13)]
    batch = sample_tokens(logits, params, generator=gens).tokens
    alone = sample_tokens(logits[2:3], params, generator=[torch.Generator().manual_seed(12)]).tokens
    assert batch[2] == alone[0]


def test_greedy_rows_are_singletons_with_zero_logprob():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0)] * 3 + [SamplingParams(top_k=1)] * 3
    out = sample_tokens(logits, params)
    assert torch.equal(out.tokens, logits.argmax(-1))
    assert out.support.sizes().tolist() == [1] * 6
    assert out.log_mu.tolist() == [0.0] * 6


def test_mixed_parameters_per_row_match_single_row_calls():
    logits = torch.randn(5, 60, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(top_k=k, top_p=p) for k, p in [(5, 1.0), (-1, 1.0), (50, 0.5), (2, 0.9), (10, 0.3)]]
    mask = support_mask(logits, params, "sglang")
    for r, p in enumerate(params):
        assert torch.equal(mask[r], support_mask(logits[r : r + 1], p, "sglang")[0])


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"top_p": 0.0}, r"top_p: must be in \(0, 1\], got 0.0"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k: must be -1"),
        ({"top_k": -2}, "top_k"),
        ({"temperature": -1.0}, "temperature: must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 0.0, "top_p": 0.9}, "temperature: must be > 0 when a support filter is active"),
        ({"min_p": 1.5}, "min_p"),
        ({"seed": -1}, "seed"),
    ],
)
def test_params_validation(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**kwargs)


def test_replay_active():
    assert not SamplingParams().replay_active
    assert SamplingParams(top_p=0.9).replay_active
    assert SamplingParams(top_k=5).replay_active
    assert SamplingParams(min_p=0.1).replay_active


def test_bad_sample_inputs():
    with pytest.raises(SamplingParamsError, match="semantics"):
        support_mask(torch.zeros(1, 3), SamplingParams(), "tgi")
    with pytest.raises(SamplingParamsError, match="2 sampling settings for 1 rows"):
        support_mask(torch.zeros(1, 3), [SamplingParams()] * 2)
    with pytest.raises(SamplingParamsError, match="expected \\[B, V\\]"):
        sample_tokens(torch.zeros(3), SamplingParams())


def test_capture_flags_select_rows_and_keep_the_draws():
    logits = torch.randn(6, 40, generator=torch.Generator().manual_seed(8))
    params = SamplingParams(top_k=10, top_p=0.9)
    full = sample_tokens(logits, params, generator=[torch.Generator().manual_seed(i) for i in range(6)])
    part = sample_tokens(
        logits, params, generator=[torch.Generator().manual_seed(i) for i in range(6)], capture=[1, 0, 0, 1, 0, 1]
    )
    assert torch.equal(full.tokens, part.tokens)
    assert part.captured.tolist() == [0, 3, 5]
    assert part.support == full.support.select([0, 3, 5])
    assert torch.equal(part.log_mu, full.log_mu[[0, 3, 5]])
    none = sample_tokens(logits, params, capture=False)
    assert none.support.num_rows == 0 and none.log_mu.numel() == 0


def test_sglang_top_k_fast_path_equals_the_full_sort(monkeypatch):
    from support_replay.core import sampling
    from support_replay.core.sampling import _columns, _keep_sglang

    taken = []
    original = sampling._top_candidates
    monkeypatch.setattr(
        sampling, "_top_candidates", lambda p, w, *a: taken.append(original(p, w, *a) is not None) or original(p, w, *a)
    )
    for logits, params in random_cases(24, rows=64, vocab=400, seed=11):
        params = [
            SamplingParams(
                temperature=p.temperature, top_k=min(p.top_k, 60) if p.top_k > 0 else 30, top_p=p.top_p, min_p=p.min_p
            )
            for p in params
        ]
        fast = support_mask(logits, params, "sglang")
        temp, top_k, top_p, min_p = _columns(params, logits.shape[1], logits.device)
        probs = torch.softmax(logits.float() / temp, dim=-1)
        probs_sort, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        full = torch.zeros_like(fast).scatter_(1, order, _keep_sglang(probs_sort, top_k, top_p, min_p))
        assert torch.equal(fast, full)
    assert sum(taken) >= 8  # the fast path ran (smooth and one-ulp cases), ties fell back


def test_bf16_ties_at_the_top_k_cut_widen_the_selection_instead_of_sorting(monkeypatch):
    """bf16 logits tie often at the k-th value: the selection widens to every tied id (no sort of
    the whole vocabulary) and keeps exactly the full sort's support."""
    from support_replay.core import sampling
    from support_replay.core.sampling import _columns, _keep_sglang

    taken = []
    original = sampling._top_candidates
    monkeypatch.setattr(
        sampling, "_top_candidates", lambda p, w, *a: taken.append(original(p, w, *a) is not None) or original(p, w, *a)
    )
    gen = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(64, 4000, generator=gen)).bfloat16()
    params = [SamplingParams(top_k=32, top_p=0.9)] * 64
    fast = support_mask(logits, params, "sglang")
    temp, top_k, top_p, min_p = _columns(params, logits.shape[1], logits.device)
    probs = torch.softmax(logits.float() / temp, dim=-1)
    top = torch.topk(probs, 33, dim=-1).values
    assert bool((top[:, 32] == top[:, 31]).any())  # the case at hand: a tie straddles the cut
    probs_sort, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    full = torch.zeros_like(fast).scatter_(1, order, _keep_sglang(probs_sort, top_k, top_p, min_p))
    assert torch.equal(fast, full) and taken == [True]


def _full_sort_support(logits, params):
    from support_replay.core.sampling import _columns, _keep_sglang

    temp, top_k, top_p, min_p = _columns(params, logits.shape[1], logits.device)
    probs = torch.softmax(logits.float() / temp, dim=-1)
    probs_sort, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    return torch.zeros(probs.shape, dtype=torch.bool).scatter_(1, order, _keep_sglang(probs_sort, top_k, top_p, min_p))


def test_a_tie_at_the_cut_inside_the_room_takes_one_selection_and_a_longer_one_a_second(monkeypatch):
    """A tie at the top-k cut that ends within TIE_ROOM values is read off the first selection (one
    topk); one longer than the room takes a second, wider one. Both give the full sort's support."""
    from support_replay.core.sampling import TIE_ROOM

    calls = []
    topk = torch.topk
    monkeypatch.setattr(torch, "topk", lambda *a, **k: calls.append(a[1]) or topk(*a, **k))
    params = [SamplingParams(top_k=8, top_p=1.0)] * 3
    base = -torch.arange(400, dtype=torch.float32) / 10  # distinct values, id 0 the largest
    for tied in (3, TIE_ROOM + 5):
        logits = base.repeat(3, 1)
        logits[:, 6 : 6 + tied] = logits[0, 6]  # ranks 6.. tie with the 7th largest: the cut at rank 8 inside
        calls.clear()
        mask = support_mask(logits, params, "sglang")
        assert torch.equal(mask, _full_sort_support(logits, params))
        assert mask[0].nonzero().squeeze(1).tolist() == list(range(8))  # ranks below k, a tie by the lower id
        assert len(calls) == (1 if tied + 6 < 8 + TIE_ROOM else 2)


def _sort_select(calls):
    """A ``select`` that is the full sort's first columns, by definition (the compiled one is checked against this)."""

    def select(probs, width):
        calls.append(width)
        values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
        return values[:, :width], ids[:, :width]

    return select


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_given_selection_and_the_rows_built_from_the_ranks_keep_the_draw_and_capture(dtype):
    """``select`` replaces torch.topk's selection and the support rows come from the kept ranks, not from a [B, V]
    mask: the tokens, the support and log mu are the default path's, on ties (bf16, integer grids) too."""
    from support_replay.core import sampling

    calls = []
    cases = list(random_cases(6, rows=32, vocab=300, seed=5)) + [
        ((3 * torch.randn(16, 4000, generator=torch.Generator().manual_seed(1))).to(dtype), [SamplingParams(top_k=32)])
    ]
    for logits, params in cases:
        logits = logits.to(dtype)
        params = params * logits.shape[0] if len(params) == 1 else params
        params = [SamplingParams(p.temperature, min(max(p.top_k, 1), 50), p.top_p, p.min_p) for p in params]
        outs = [
            sample_tokens(
                logits,
                params,
                "sglang",
                generator=[torch.Generator().manual_seed(i) for i in range(len(params))],
                select=select,
            )  # fmt: skip
            for select in (None, _sort_select(calls))
        ]
        assert torch.equal(outs[0].tokens, outs[1].tokens)
        assert outs[0].support == outs[1].support
        assert torch.equal(outs[0].log_mu, outs[1].log_mu)
        mask = support_mask(logits, params, "sglang")
        ids, valid, cols, counts = sampling._padded_rows(mask)
        assert outs[1].support == SupportTable(
            cols.to(torch.int32).numpy(), sampling.offsets_from_sizes(counts.numpy())
        )
    assert calls  # the selection ran


def test_the_rows_of_the_kept_ranks_are_the_padded_rows_of_their_mask():
    from support_replay.core.sampling import _padded_rows, _rows_of_ranks

    g = torch.Generator().manual_seed(2)
    order = torch.stack([torch.randperm(50, generator=g)[:9] for _ in range(7)])
    keep = torch.rand(7, 9, generator=g) < 0.5
    keep[3] = False  # a row keeping nothing pads to one column, as the mask's rows do
    mask = torch.zeros(7, 50, dtype=torch.bool).scatter_(1, order, keep)
    for got, want in zip(_rows_of_ranks(keep, order, 50), _padded_rows(mask)):
        assert got.dtype == want.dtype and torch.equal(got, want)
    none = torch.zeros(2, 4, dtype=torch.bool)
    for got, want in zip(_rows_of_ranks(none, torch.arange(8).view(2, 4), 8), _padded_rows(torch.zeros(2, 8).bool())):
        assert torch.equal(got, want)


def test_a_selection_that_does_not_run_leaves_torch_topk():
    logits = 3 * torch.randn(4, 1000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(top_k=20, top_p=0.9)
    declined = sample_tokens(logits, params, generator=torch.Generator().manual_seed(0), select=lambda p, w: None)
    default = sample_tokens(logits, params, generator=torch.Generator().manual_seed(0))
    assert torch.equal(declined.tokens, default.tokens) and declined.support == default.support
