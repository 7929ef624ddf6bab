"""The sampler's compiled top-k selection (modeling/top_candidates.py): the full sort's first columns exactly, ties,
NaN and -inf included; the engine samples with it; where it does not build, torch.topk stays."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from support_replay.engine import Engine
from support_replay.modeling import cpu_kernels, top_candidates

pytestmark = pytest.mark.float_bits  # a kernel built per vector ISA: CI reruns it on AVX2 kernels


@pytest.fixture(scope="module")
def select():
    built, why = top_candidates.compiled()
    if built is None:
        pytest.skip(f"the compiled selection cannot run here: {why}")
    return built


def _sorted(probs, width):
    values, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    return values[:, :width], ids[:, :width]


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 12),
    vocab=st.integers(1, 3000),
    width=st.integers(1, 80),
    kind=st.sampled_from(["smooth", "bf16", "grid", "tail zeros", "masked", "flat", "ascending", "nan", "-inf"]),
    seed=st.integers(0, 2**16),
)
def test_the_selection_is_the_full_sorts_first_columns(select, rows, vocab, width, kind, seed):
    width = min(width, vocab)
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
    values, ids = select(probs, width)
    want_values, want_ids = _sorted(probs, width)
    assert torch.equal(ids, want_ids)
    assert torch.equal(values.nan_to_num(-1.0), want_values.nan_to_num(-1.0))


def test_it_declines_what_it_does_not_compute_and_refuses_a_bad_width(select):
    probs = torch.softmax(torch.randn(3, 100), -1)
    assert select(probs.double(), 5) is None
    assert select(probs[0], 5) is None
    values, ids = select(probs.t().contiguous().t(), 5)  # a strided view is read as its values
    assert torch.equal(ids, _sorted(probs, 5)[1])
    kernel = cpu_kernels.built()[0].top_candidates
    with pytest.raises(RuntimeError, match=r"width must be in \[1, 100\], got 0"):
        kernel(probs, 0)


def test_the_engine_samples_with_it_and_keeps_torch_topk_without_a_build(tiny_checkpoint, select, unbuildable_kernels):
    engine = Engine.from_pretrained(tiny_checkpoint)
    assert engine.sample.select is select
    with unbuildable_kernels():
        assert top_candidates.selection() is None
