import math

import pytest
import torch

from support_replay import SupportReplayError
from support_replay.core.losses import (
    aggregate,
    grpo_advantages,
    kl_estimate,
    logprob_mismatch_metrics,
    policy_token_loss,
    support_size_metrics,
    token_weights,
    truncated_importance_weights,
)


def test_aggregate_token_and_sequence():
    values = torch.tensor([[1.0, 2.0, 3.0], [10.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [0, 0, 0]])
    assert aggregate(values, mask, "token").item() == pytest.approx((1 + 2 + 3 + 10) / 4)
    assert aggregate(values, mask, "sequence").item() == pytest.approx((2 + 10) / 2)
    with pytest.raises(SupportReplayError, match="aggregation"):
        aggregate(values, mask, "batch")


def test_grpo_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    adv = grpo_advantages(rewards, 3, normalize_std=False)
    assert adv.tolist() == pytest.approx([2 / 3, -1 / 3, -1 / 3, -2 / 3, 1 / 3, 1 / 3])
    norm = grpo_advantages(rewards, 3)
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)
    assert norm[0].item() == pytest.approx((2 / 3) / (std + 1e-6))
    assert grpo_advantages(torch.ones(4), 2).tolist() == [0.0] * 4  # equal rewards: no signal
    with pytest.raises(SupportReplayError, match="groups of 4"):
        grpo_advantages(torch.ones(6), 4)


def test_policy_token_loss_by_hand():
    # ratios 1.5 (clipped at 1.2 for A>0), 0.5 (clipped at 0.8 for A<0 -> pessimistic max), 1.0
    old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.5, 0.5, 1.0])).requires_grad_()
    adv = torch.tensor([2.0, -1.0, 3.0])
    terms = policy_token_loss(logp, old, adv, clip_low=0.2)
    # token losses: -min(3.0, 2.4) = -2.4 ; -min(-0.5, -0.8) = 0.8 ; -3.0
    assert terms.total.tolist() == pytest.approx([-2.4, 0.8, -3.0])
    assert terms.clipped.tolist() == [True, True, False]
    loss = (terms.total * token_weights(torch.ones(3), [3], "token", batch_tokens=3, batch_sequences=1)).sum()
    loss.backward()
    # clipped tokens get no gradient; the unclipped one gets -A * ratio / n
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -1.0])


def test_policy_token_loss_importance_weights_kl_and_entropy():
    logp = torch.zeros(3)
    terms = policy_token_loss(
        logp,
        logp,
        torch.tensor([1.0, 1.0, -2.0]),
        importance_weights=torch.tensor([0.5, 1.0, 2.0]),
        kl=torch.tensor([0.1, 0.2, 0.3]),
        kl_coef=0.5,
        entropy=torch.tensor([1.0, 2.0, 3.0]),
        entropy_coef=0.1,
    )
    # -r A w + 0.5 kl - 0.1 H, with r = 1
    assert terms.total.tolist() == pytest.approx([-0.5 + 0.05 - 0.1, -1.0 + 0.1 - 0.2, 4.0 + 0.15 - 0.3])


def test_sequence_aggregation_against_a_hand_computation():
    """Two micro-batches of one global batch, weighted by token_weights, give the mean over
    sequences of each sequence's mean over its trained tokens, computed here by hand."""
    values = [torch.tensor([1.0, 2.0, 3.0, 10.0, 0.0]), torch.tensor([4.0, 8.0, 7.0])]
    masks = [torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])]
    lengths = [[3, 2], [1, 2]]  # sequences a (3 tokens), b (2), c (1, nothing trained), d (2)
    # a: (1+2+3)/3 = 2; b: 10/1 = 10; c: left out; d: 8/1 = 8  -> (2 + 10 + 8) / 3
    total = sum(
        (v * token_weights(m, n, "sequence", batch_tokens=5, batch_sequences=3)).sum()
        for v, m, n in zip(values, masks, lengths)
    )
    assert total.item() == pytest.approx((2 + 10 + 8) / 3)
    token = sum(
        (v * token_weights(m, n, "token", batch_tokens=5, batch_sequences=3)).sum()
        for v, m, n in zip(values, masks, lengths)
    )
    assert token.item() == pytest.approx((1 + 2 + 3 + 10 + 8) / 5)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([-1.0]), torch.tensor([-1.5])
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(0.5)
    assert kl_estimate(logp, ref, "k2").item() == pytest.approx(0.125)
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(math.exp(-0.5) + 0.5 - 1)
    with pytest.raises(SupportReplayError, match="kl estimator"):
        kl_estimate(logp, ref, "k4")


def test_kl_estimators_are_unbiased_for_the_true_kl():
    g = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(6, generator=g), -1)
    q = torch.softmax(torch.randn(6, generator=g), -1)
    true_kl = float((p * (p / q).log()).sum())
    draws = torch.multinomial(p, 200000, replacement=True, generator=g)
    for kind in ("k1", "k3"):
        est = kl_estimate(p.log()[draws], q.log()[draws], kind).mean().item()
        assert est == pytest.approx(true_kl, abs=0.01)


def test_truncated_importance_weights():
    w = truncated_importance_weights(torch.tensor([0.0, 0.0]), torch.tensor([-2.0, 0.5]), cap=2.0)
    assert w.tolist() == pytest.approx([2.0, math.exp(-0.5)])


def test_mismatch_metrics():
    trainer = torch.tensor([[-1.0, -2.0, -3.0]])
    rollout = torch.tensor([[-1.0, -2.5, -9.0]])
    mask = torch.tensor([[1, 1, 0]])
    m = logprob_mismatch_metrics(trainer, rollout, mask)
    assert m["abs_diff_max"] == pytest.approx(0.5)
    assert m["abs_diff_mean"] == pytest.approx(0.25)
    assert m["ratio_mean"] == pytest.approx((1 + math.exp(0.5)) / 2)
    assert m["ratio_outside_10pct"] == pytest.approx(0.5)
    assert m["mismatch_kl"] == pytest.approx((math.exp(0.5) - 0.5 - 1) / 2)


def test_support_size_metrics():
    m = support_size_metrics([1, 1, 2, 8])
    assert m["support_mean"] == 3.0 and m["support_median"] == 1.5
    assert m["support_max"] == 8 and m["singleton_share"] == 0.5
