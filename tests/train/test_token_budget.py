"""Micro-batches cut by a token budget (--max-tokens-per-micro-batch)."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe_helpers import run_config
from support_replay.errors import ConfigError
from support_replay.rollout.sample import Sample
from support_replay.train import train
from support_replay.train.batches import token_budget_split


def samples_of(lengths):
    return [
        Sample(index=i, group=0, prompt_ids=[1] * p, response_ids=[2] * r, loss_mask=np.ones(r, np.int8))
        for i, (p, r) in enumerate(lengths)
    ]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 40), st.integers(1, 60)), min_size=1, max_size=6),
    st.integers(1, 4),
    st.integers(1, 400),
)
def test_every_rank_gets_the_same_count_within_the_budget(per_rank_lengths, world, budget):
    lengths = per_rank_lengths * world  # equal shares, as --global-batch-size divisible by the ranks makes them
    samples = samples_of(lengths)
    order = sorted(range(len(samples)), key=lambda i: -sum(lengths[i]))
    per_rank = len(order) // world
    shares = [order[r * per_rank : (r + 1) * per_rank] for r in range(world)]
    plans = token_budget_split(samples, shares, budget)
    assert len({len(p) for p in plans}) == 1  # the same number of forwards on every rank
    for share, parts in zip(shares, plans):
        assert [i for part in parts for i in part] == share  # every sample once, in order
        for part in parts:
            width = max(sum(lengths[i]) for i in part)
            assert part and (len(part) == 1 or len(part) * width <= budget)  # only a sample alone may pass the budget


def test_budget_packs_short_samples_together_and_long_ones_alone():
    samples = samples_of([(10, 90), (10, 10), (5, 5), (5, 5), (5, 5), (5, 5)])
    assert token_budget_split(samples, [list(range(6))], 100) == [[[0], [1, 2, 3, 4, 5]]]  # 100 alone; 5 x 20 = 100
    # a second rank needing 3 micro-batches makes this one split its largest in two
    assert token_budget_split(samples + samples_of([(50, 50)] * 3), [list(range(6)), [6, 7, 8]], 100)[0] == [
        [0],
        [1, 2],
        [3, 4, 5],
    ]


def test_a_run_under_a_token_budget_trains_as_one_cut_by_samples(tiny_checkpoint, tmp_path):
    by_samples = train(
        run_config(tiny_checkpoint, tmp_path / "s", num_rollout=1, global_batch_size=8, micro_batch_size=2)
    )
    by_tokens = train(
        run_config(
            tiny_checkpoint,
            tmp_path / "t",
            num_rollout=1,
            global_batch_size=8,
            micro_batch_size=None,
            max_tokens_per_micro_batch=60,
        )
    )
    assert by_tokens[0]["loss"] == pytest.approx(by_samples[0]["loss"], abs=1e-6)
    assert by_tokens[0]["grad_norm"] == pytest.approx(by_samples[0]["grad_norm"], rel=1e-5)


def test_both_micro_batch_flags_are_refused(tiny_checkpoint, tmp_path):
    with pytest.raises(
        ConfigError,
        match="--micro-batch-size=2: counts samples, --max-tokens-per-micro-batch=64 tokens: give one of them",
    ):
        run_config(tiny_checkpoint, tmp_path, micro_batch_size=2, max_tokens_per_micro_batch=64)
