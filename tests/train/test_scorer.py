"""The scorer is chosen once (train/scorer.py): its head follows the run's flags, and a head that
scores raw logits refuses a batch that brings penalties instead of switching head."""

import pytest
import torch

from support_replay.errors import ConfigError
from support_replay.train.actor import load_scoring_model
from support_replay.train.scorer import Outputs, Scorer, head_for


@pytest.mark.parametrize(
    "replay, sparse, batch_invariant, head",
    [
        (True, True, False, "sparse"),
        (True, True, True, "union"),
        (True, False, False, "dense"),
        (True, False, True, "dense"),
        (False, False, False, "full"),
    ],
)
def test_the_head_follows_the_flags(replay, sparse, batch_invariant, head):
    assert head_for(replay=replay, sparse=sparse, batch_invariant=batch_invariant) == head


def test_a_sparse_head_without_replay_is_refused():
    with pytest.raises(ConfigError, match="needs sampling-support replay"):
        head_for(replay=False, sparse=True, batch_invariant=False)


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["sparse", "union"])
def test_a_raw_logit_head_refuses_penalties(tiny_checkpoint, batch_invariant):
    model = load_scoring_model(tiny_checkpoint, "cpu", batch_invariant=batch_invariant)
    scorer = Scorer(model, 1.0, replay=True, sparse=True, outputs=Outputs(full_detached=True))
    hidden = model.hf.config.hidden_size
    h, targets = torch.randn(3, hidden), torch.tensor([1, 2, 3])
    support = (torch.tensor([[1, 4], [2, 5], [3, 6]]), torch.ones(3, 2, dtype=torch.bool))
    logp, full, entropy = scorer.rows(h, targets, support, None)
    assert logp.shape == (3,) and full.shape == (3,) and entropy is None
    with pytest.raises(ConfigError, match=f"the {scorer.head} head scores raw logits"):
        scorer.rows(h, targets, support, object())
