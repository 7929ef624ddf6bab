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
        (True, True, True, "invariant"),
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


@pytest.mark.parametrize("batch_invariant", [False, True], ids=["sparse", "invariant"])
def test_a_raw_logit_head_refuses_penalties(tiny_checkpoint, batch_invariant):
    model = load_scoring_model(tiny_checkpoint, "cpu", batch_invariant=batch_invariant)
    scorer = Scorer(model, 1.0, replay=True, sparse=True, outputs=Outputs(full_detached=True))
    hidden = model.hf.config.hidden_size
    h, targets = torch.randn(3, hidden), torch.tensor([1, 2, 3])
    support = (torch.tensor([[1, 4], [2, 5], [3, 6]]), torch.ones(3, 2, dtype=torch.bool))
    logp, full, entropy, rows = scorer.rows(h, targets, support, None)
    assert logp.shape == (3,) and full.shape == (3,) and entropy is None and rows is None
    with pytest.raises(ConfigError, match=f"the {scorer.head} head scores raw logits"):
        scorer.rows(h, targets, support, object())


@pytest.mark.parametrize(
    "sparse, batch_invariant", [(True, False), (True, True), (False, False)], ids=["sparse", "invariant", "dense"]
)
def test_every_heads_support_rows_agree_and_hold_the_selected_score(tiny_checkpoint, sparse, batch_invariant):
    """Score centering's log pi(v | S_t) of every support id: the same from every head (sparse and union
    gather the head's rows, never [T, V]), the selected id's column the ratio's score, 0 at padding."""
    model = load_scoring_model(tiny_checkpoint, "cpu", batch_invariant=batch_invariant)
    scorer = Scorer(model, 0.8, replay=True, sparse=sparse, outputs=Outputs(support_rows=True))
    dense = Scorer(load_scoring_model(tiny_checkpoint, "cpu"), 0.8, replay=True, sparse=False,
                   outputs=Outputs(support_rows=True))  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(4, model.hf.config.hidden_size, generator=gen, requires_grad=True)
    ids = torch.tensor([[1, 4, 9], [2, 5, 0], [3, 0, 0], [7, 8, 11]])
    valid = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=torch.bool)
    targets = torch.tensor([4, 2, 3, 11])
    logp, _, _, rows = scorer.rows(h, targets, (ids, valid), None)
    _, _, _, reference = dense.rows(h, targets, (ids, valid), None)
    torch.testing.assert_close(rows, reference, rtol=1e-5, atol=1e-5)
    column = (ids == targets[:, None]).int().argmax(1)
    torch.testing.assert_close(rows.gather(1, column[:, None]).squeeze(1), logp, rtol=1e-5, atol=1e-5)
    assert (rows[~valid] == 0).all()
    rows.sum().backward()
    assert h.grad is not None and h.grad.abs().sum() > 0
