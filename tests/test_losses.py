import math

import pytest
import torch

from support_replay import SupportReplayError
from support_replay.losses import (
    aggregate,
    grpo_advantages,
    kl_estimate,
    logprob_mismatch_metrics,
    policy_loss,
    support_size_metrics,
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


def test_policy_loss_by_hand():
    # ratios 1.5 (clipped at 1.2 for A>0), 0.5 (clipped at 0.8 for A<0 -> pessimistic max), 1.0
    old = torch.zeros(1, 3)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.0]])).requires_grad_()
    adv = torch.tensor([[2.0, -1.0, 3.0]])
    mask = torch.ones(1, 3)
    loss, metrics = policy_loss(logp, old, adv, mask, clip_low=0.2)
    # token losses: -min(3.0, 2.4) = -2.4 ; -min(-0.5, -0.8) = 0.8 ; -3.0
    assert loss.item() == pytest.approx((-2.4 + 0.8 - 3.0) / 3)
    assert metrics["clip_fraction"] == pytest.approx(2 / 3)
    loss.backward()
    # clipped tokens get no gradient; the unclipped one gets -A * ratio / n
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.0, -1.0])


def test_policy_loss_sequence_advantage_and_weights():
    logp = torch.zeros(2, 2)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[1, 1], [1, 0]])
    weights = torch.tensor([[0.5, 1.0], [2.0, 1.0]])
    loss, _ = policy_loss(logp, logp, adv, mask, importance_weights=weights)
    assert loss.item() == pytest.approx((-0.5 - 1.0 + 4.0) / 3)


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
