"""The sampler's compiled top-k selection (kernels/top_candidates.py): the full sort's first columns exactly, ties,
NaN and -inf included; SGLang's rule over them (``sglang_rows``) gives the torch operations' support and the same
draws; the engine samples with it; where it does not build, torch.topk stays."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from support_replay.core.sampling import SamplingParams, _keep_sglang, _rows_of_ranks, sample_tokens
from support_replay.engine import Engine
from support_replay.kernels import build, top_candidates

pytestmark = pytest.mark.float_bits  # a kernel built per vector ISA: CI reruns it on AVX2 kernels


@pytest.fixture(scope="module")
def select():
    built, why = top_candidates.compiled()
    if built is None:
        pytest.skip(f"the compiled selection cannot run here: {why}")
    return built


KINDS = ["smooth", "bf16", "grid", "tail zeros", "masked", "flat", "ascending", "nan", "-inf"]


def _probs(rows, vocab, kind, seed):
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(3 * torch.randn(rows, vocab, generator=g), -1)
    if kind == "bf16":
        probs = probs.bfloat16().float()
    elif kind == "grid":
        probs = torch.randint(0, 4, (rows, vocab), generator=g).float()
    elif kind == "tail zeros":
        probs[:, vocab // 3 :] = 0.0
    elif kind == "masked":  # a grammar's mask: a few allowed tokens, exact zeros elsewhere (ties past the allowed)
        probs[torch.rand(rows, vocab, generator=g) < 0.98] = 0.0
    elif kind == "flat":
        probs = torch.full((rows, vocab), 1.0 / vocab)
    elif kind == "ascending":  # every chunk's largest value above the last's
        probs = torch.sort(probs, dim=-1).values
    elif kind == "nan":
        probs[torch.rand(rows, vocab, generator=g) < 0.01] = float("nan")
    elif kind == "-inf":
        probs[torch.rand(rows, vocab, generator=g) < 0.7] = float("-inf")
    return probs


def _sorted(probs, width):
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[:, :width], ids[:, :width]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 12),
    vocab=st.integers(1, 3000),
    width=st.integers(1, 80),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**16),
)
def test_the_selection_is_the_full_sorts_first_columns(select, rows, vocab, width, kind, seed):
    width = min(width, vocab)
    probs = _probs(rows, vocab, kind, seed)
    values, ids = select(probs, width)
    want_values, want_ids = _sorted(probs, width)
    assert torch.equal(ids, want_ids)
    assert torch.equal(values.nan_to_num(-1.0), want_values.nan_to_num(-1.0))


def _settings(rows, draw, vocab):
    top_k = torch.tensor([[min(draw(st.integers(1, 64)), vocab)] for _ in range(rows)])
    top_p = torch.tensor([[draw(st.sampled_from([1.0, 0.999999, 0.97, 0.8, 0.5, 1e-6]))] for _ in range(rows)])
    min_p = torch.tensor([[draw(st.sampled_from([0.0, 0.0, 0.01, 0.1, 1.0]))] for _ in range(rows)])
    return top_k, top_p.double(), min_p.float()


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 12), vocab=st.integers(2, 3000), kind=st.sampled_from(KINDS), seed=st.integers(0, 2**16),
       data=st.data())  # fmt: skip
def test_sglang_rows_are_the_rule_over_the_full_sort(select, rows, vocab, kind, seed, data):
    probs = _probs(rows, vocab, kind, seed)
    top_k, top_p, min_p = _settings(rows, data.draw, vocab)
    width = int(top_k.max())
    values, order = _sorted(probs, width)
    want = _rows_of_ranks(_keep_sglang(values, top_k, top_p, min_p), order, vocab)
    got = select.sglang_rows(probs, width, top_k, top_p, min_p)
    for name, a, b in zip(("ids", "valid", "cols", "counts"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name


def test_the_start_up_check_finds_a_rule_that_differs(select):
    kernel = build.built()[0].sglang_rows
    assert top_candidates.check_rows(kernel) == ""

    def float_prefix_sums(probs, width, top_k, top_p, min_p):  # the prefix sums added in float32: other roundings
        values, order = _sorted(probs, width)
        exclusive, running = torch.empty_like(values), torch.zeros(values.shape[0])
        for j in range(width):
            running = running + values[:, j]
            exclusive[:, j] = running - values[:, j]
        keep = (torch.arange(width)[None, :] < top_k) & ((exclusive <= top_p.float()) | (top_p >= 1))
        keep &= (values >= min_p * values[:, :1]) & (values > 0)
        return _rows_of_ranks(keep, order, probs.shape[1])

    def no_min_p(probs, width, top_k, top_p, min_p):
        return kernel(probs, width, top_k, top_p, torch.zeros_like(min_p))

    assert "differs from SGLang's rule" in top_candidates.check_rows(no_min_p)
    assert "where top_p is a rank's exclusive mass" in top_candidates.check_rows(float_prefix_sums)
    without_rule = top_candidates.Selection(build.built()[0], rows=False)  # where the rule's check failed
    probs = torch.softmax(torch.randn(3, 400), -1)
    columns = torch.tensor([[5]] * 3), torch.ones(3, 1, dtype=torch.float64), torch.zeros(3, 1)
    assert without_rule.sglang_rows(probs, 5, *columns) is None
    assert torch.equal(without_rule(probs, 5)[1], _sorted(probs, 5)[1])


def assert_samples_alike(logits, params, select):
    """``sample_tokens`` with the kernels and without (PyTorch's operations), each row's generator seeded alike: the
    same tokens, log mu and supports."""

    def draw(chosen):
        generators = [torch.Generator().manual_seed(i) for i in range(len(params))]
        return sample_tokens(logits, params, "sglang", generator=generators, select=chosen)

    a, b = draw(select), draw(None)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.log_mu, b.log_mu)
    assert (a.support.ids == b.support.ids).all() and (a.support.offsets == b.support.offsets).all()


def test_sampling_with_the_kernels_draws_and_scores_as_without(select):
    g = torch.Generator().manual_seed(5)
    logits = 4 * torch.randn(16, 5000, generator=g)
    params = [SamplingParams(top_k=k, top_p=p, min_p=m, seed=i) for i, (k, p, m) in
              enumerate([(32, 0.8, 0.0), (20, 0.97, 0.05), (1, 1.0, 0.0), (64, 1.0, 0.0)] * 4)]  # fmt: skip

    assert_samples_alike(logits, params, select)


def test_the_compiled_draw_is_the_samplers_and_its_check_finds_one_that_is_not(select, monkeypatch):
    """``sglang_draw``: the rows and each row's token from its own generator, the sampler's operations in one call;
    the sampler takes it where every row has a generator, and the start-up check refuses a draw that differs."""
    module = build.built()[0]
    assert top_candidates.check_draw(module.sglang_draw) == ""

    def one_more_value(probs, width, top_k, top_p, min_p, generators):  # row 0's generator drawn once more
        torch.empty(1).exponential_(generator=generators[0])
        return module.sglang_draw(probs, width, top_k, top_p, min_p, generators)

    def lowest_ratio(probs, width, top_k, top_p, min_p, generators):
        ids, valid, cols, counts, tokens = module.sglang_draw(probs, width, top_k, top_p, min_p, generators)
        return ids, valid, cols, counts, ids[:, 0]

    assert "takes another count of values from the generators" in top_candidates.check_draw(one_more_value)
    assert "differs from the sampler's" in top_candidates.check_draw(lowest_ratio)
    calls = []
    monkeypatch.setattr(select, "_draw", lambda *a: calls.append(1) or module.sglang_draw(*a))
    monkeypatch.setattr(select, "_draw_logits", None)  # where the softmax's check failed: torch.softmax, then this
    logits = 4 * torch.randn(4, 3000, generator=torch.Generator().manual_seed(9))
    params = [SamplingParams(top_k=32, top_p=0.9, seed=i) for i in range(4)]
    generators = [torch.Generator().manual_seed(i) for i in range(4)]
    sample_tokens(logits, params, "sglang", generator=generators, select=select)
    assert calls == [1]
    sample_tokens(logits, params, "sglang", generator=None, select=select)  # one stream for the batch: Python's draw
    assert calls == [1]
    without = top_candidates.Selection(module, draw=False)  # where the draw's check failed
    columns = torch.tensor([[5]] * 3), torch.ones(3, 1, dtype=torch.float64), torch.zeros(3, 1)
    assert without.sglang_draw(torch.softmax(torch.randn(3, 400), -1), 5, *columns, generators[:3]) is None


def test_the_draw_from_logits_is_softmax_then_the_draw_and_its_check_finds_one_that_is_not(select, monkeypatch):
    """``sglang_draw_logits``: each row's softmax(z / T) with torch.softmax's bits and the draw over it in one call; the
    sampler takes it first, at any temperatures, and the start-up check refuses a softmax an ulp off."""
    module = build.built()[0]
    assert top_candidates.check_draw_logits(module.sglang_draw_logits, module.sglang_draw) == ""

    def ulp_off(logits, width, temperature, top_k, top_p, min_p, generators):
        *drawn, probs = module.sglang_draw_logits(logits, width, temperature, top_k, top_p, min_p, generators)
        probs[0, 7] = torch.nextafter(probs[0, 7], torch.tensor(1.0))
        return (*drawn, probs)

    def t_ignored(logits, width, temperature, top_k, top_p, min_p, generators):
        return module.sglang_draw_logits(logits, width, torch.ones_like(temperature), top_k, top_p, min_p, generators)

    assert "its softmax differs from torch.softmax" in top_candidates.check_draw_logits(ulp_off, module.sglang_draw)
    assert "temperatures [0.7, 1.0, 1.3, 0.05]" in top_candidates.check_draw_logits(t_ignored, module.sglang_draw)
    calls = []
    monkeypatch.setattr(select, "_draw_logits", lambda *a: calls.append(1) or module.sglang_draw_logits(*a))
    g = torch.Generator().manual_seed(11)
    logits = 4 * torch.randn(8, 6000, generator=g)
    logits[3, 50:] = float("-inf")  # a grammar's mask
    for temps in ([1.0] * 8, [0.6, 1.0, 1.7, 0.9] * 2):
        params = [SamplingParams(temperature=t, top_k=40, top_p=0.9, min_p=0.02 * (i % 2), seed=i)
                  for i, t in enumerate(temps)]  # fmt: skip
        assert_samples_alike(logits, params, select)
    assert calls == [1, 1]
    columns = torch.tensor([[5]] * 8), torch.ones(8, 1, dtype=torch.float64), torch.zeros(8, 1)
    with pytest.raises(RuntimeError, match="sglang_draw_logits: temperature of 8 float32 values"):
        module.sglang_draw_logits(logits, 5, torch.ones(8, 1, dtype=torch.float64), *columns, [torch.Generator()] * 8)
    assert select.sglang_draw_logits(logits.double(), 5, None, None, None, None, None) is None


def test_it_declines_what_it_does_not_compute_and_refuses_a_bad_width(select):
    probs = torch.softmax(torch.randn(3, 100), -1)
    assert select(probs.double(), 5) is None
    assert select(probs[0], 5) is None
    columns = torch.tensor([[5]] * 3), torch.ones(3, 1, dtype=torch.float64), torch.zeros(3, 1)
    assert select.sglang_rows(probs.double(), 5, *columns) is None
    with pytest.raises(RuntimeError, match="sglang_rows: top_p of 3 float64 values"):
        select.sglang_rows(probs, 5, columns[0], columns[1].float(), columns[2])
    values, ids = select(probs.t().contiguous().t(), 5)  # a strided view is read as its values
    assert torch.equal(ids, _sorted(probs, 5)[1])
    kernel = build.built()[0].top_candidates
    with pytest.raises(RuntimeError, match=r"width must be in \[1, 100\], got 0"):
        kernel(probs, 0)


def test_the_engine_samples_with_it_and_keeps_torch_topk_without_a_build(tiny_checkpoint, select, unbuildable_kernels):
    engine = Engine.from_pretrained(tiny_checkpoint)
    assert engine.sample.select is select
    with unbuildable_kernels():
        assert top_candidates.selection() is None
