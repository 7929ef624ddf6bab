"""Routing replay across a recompute (train/batches.py): the tokens an earlier computation sampled are scored in a
row of their own under its routing, the rest under the final one's; packed or not, each token's score is the one
its own computation gives alone."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from support_replay.errors import SampleError
from support_replay.rollout.sample import Sample, check_sample_routing
from support_replay.train.actor import load_scoring_model
from support_replay.train.batches import build_micro_batch
from support_replay.train.scorer import Scorer

PROMPT, RESPONSE, END = [5, 9, 2, 7], [11, 3, 8, 14, 6, 1, 12], 3


def routed(rng, shape, positions: int) -> np.ndarray:
    """Random valid top-k experts for every layer of ``positions`` positions."""
    return np.argsort(rng.random((positions, shape.layers, shape.num_experts)), -1)[..., : shape.top_k].astype(np.int32)


def sample(index, routing, history=(), response=RESPONSE) -> Sample:
    return Sample(
        index, 0, list(PROMPT), list(response), np.ones(len(response), np.int8), routing=routing,
        routing_history=list(history),
    )  # fmt: skip


@pytest.fixture(scope="module")
def scorer(tiny_moe_checkpoint):
    model = load_scoring_model(tiny_moe_checkpoint, "cpu").eval().requires_grad_(False)
    model.replay_routing = True
    return Scorer(model, 1.0, replay=False, sparse=False), model.routing.shape


def scores(scorer, samples, pack: bool) -> list[torch.Tensor]:
    batch = build_micro_batch(samples, list(range(len(samples))), False, "cpu", pack=pack)
    by_index = dict(zip(batch.indices, batch.split(scorer(batch).logp)))
    return [by_index[i] for i in range(len(samples))]


@pytest.mark.parametrize("pack", [False, True])
def test_each_token_is_scored_under_the_routing_of_the_computation_that_sampled_it(scorer, pack):
    scorer, shape = scorer
    rng = np.random.default_rng(0)
    final = routed(rng, shape, len(PROMPT) + len(RESPONSE) - 1)
    earlier = routed(rng, shape, len(PROMPT) + END - 1)  # sampled tokens [0, END), then a recompute
    straddling = sample(0, final, [earlier])
    mate = sample(1, final.copy())  # the same prompt and routing: one packed row with the straddling one
    got = scores(scorer, [straddling, mate], pack)
    alone_earlier = scores(scorer, [sample(0, earlier, response=RESPONSE[:END])], pack)[0]
    alone_final = scores(scorer, [sample(0, final)], pack)[0]
    torch.testing.assert_close(got[0][:END], alone_earlier, rtol=0, atol=1e-5)
    torch.testing.assert_close(got[0][END:], alone_final[END:], rtol=0, atol=1e-5)
    torch.testing.assert_close(got[1], alone_final, rtol=0, atol=1e-5)
    assert (got[0][:END] - alone_final[:END]).abs().max() > 1e-3  # the routing mattered to those tokens


def test_a_sample_s_routing_history_fails_closed(scorer):
    _, shape = scorer
    rng = np.random.default_rng(1)
    final = routed(rng, shape, len(PROMPT) + len(RESPONSE) - 1)
    check_sample_routing(sample(3, final, [routed(rng, shape, 5), routed(rng, shape, 8)]), shape)
    with pytest.raises(SampleError, match=r"sample 3: routing_history\[1\] covers 5 positions"):
        check_sample_routing(sample(3, final, [routed(rng, shape, 5), routed(rng, shape, 5)]), shape)
    with pytest.raises(SampleError, match=r"routing_history\[0\] covers 10 positions"):
        check_sample_routing(sample(3, final, [final.copy()]), shape)
    bad = routed(rng, shape, 6)
    bad[2, -1, 0] = shape.num_experts
    with pytest.raises(SampleError, match=r"routing_history\[0\]: position 2 layer .*outside"):
        check_sample_routing(sample(3, final, [bad]), shape)
