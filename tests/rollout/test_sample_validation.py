"""Every sample is checked where it enters (docs/contract.md), with its index in the message."""

import numpy as np
import pytest

from support_replay import SupportTable
from support_replay.rollout import Sample, SampleError, validate_sample

V = 50


def sample(**kw):
    base = dict(
        index=3,
        group=0,
        prompt_ids=[1, 2],
        response_ids=[5, 7, 9],
        loss_mask=np.ones(3, np.int8),
        log_mu=np.array([-0.5, 0.0, -1.0], np.float32),
        support=SupportTable.from_lists([[5, 6], [7], [2, 9]]),
        temperature=1.0,
    )
    base.update(kw)
    return Sample(**base)


def check(s, replay=True, temperature=1.0):
    return validate_sample(s, V, replay=replay, temperature=temperature)


def test_a_good_sample_passes():
    assert check(sample()).index == 3


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(support=None), "sample 3: replay is on but the sample carries no support"),
        (dict(log_mu=None), "sample 3: replay is on but the sample carries no support / rollout log mu"),
        (dict(support=SupportTable.from_lists([[5], [7]])), "sample 3: support has 2 rows for 3 response tokens"),
        (dict(log_mu=np.zeros(2, np.float32)), "sample 3: 2 rollout log-probs for 3 response tokens"),
        (
            dict(support=SupportTable.from_lists([[5, 6], [8], [2, 9]])),
            "sample 3 support row 1: selected token 7 is not in its support",
        ),
        (dict(support=SupportTable([5, 5, 7, 9], [0, 2, 3, 4])), "sample 3 support row 0: duplicate id 5"),
        (
            dict(support=SupportTable.from_lists([[5, 60], [7], [9]])),
            r"sample 3 support row 0: id 60 outside the vocabulary",
        ),
        (dict(support=SupportTable([5, 7, 9], [0, 1, 1, 3])), "row 1: empty support"),
        (dict(log_mu=np.array([-0.5, np.nan, -1.0], np.float32)), "sample 3 token 1: rollout log mu nan is not finite"),
        (dict(log_mu=np.array([-0.5, -np.inf, -1.0], np.float32)), "sample 3 token 1: rollout log mu -inf"),
        (dict(temperature=0.7), "sample 3: sampled at temperature 0.7, but the rollout temperature is 1.0"),
        (
            dict(loss_mask=np.array([1, 1, 0], np.int8)),
            "sample 3 token 2: an inserted token needs the singleton support and log mu 0",
        ),
        (dict(loss_mask=np.ones(2, np.int8)), "sample 3: loss mask of 2 for 3 response tokens"),
        (dict(response_ids=[5, 7, 99]), "sample 3: token 99 outside the vocabulary"),
        (dict(response_ids=[], loss_mask=np.zeros(0, np.int8)), "sample 3: empty response"),
    ],
)
def test_rejections(kw, message):
    with pytest.raises(SampleError, match=message):
        check(sample(**kw))


def test_inserted_tokens_with_singleton_support_pass():
    s = sample(loss_mask=np.array([1, 0, 1], np.int8))  # token 1 has {7} and log mu 0
    assert check(s) is s


def test_without_replay_no_support_is_needed():
    assert check(sample(support=None, log_mu=None), replay=False).index == 3
