"""Score centering on the replayed support against a float64 reference of its gradient (docs/math.md)."""

from __future__ import annotations

import pytest
import torch

from support_replay.core.logprobs import support_logprobs, support_rows_logprobs
from support_replay.core.losses import (
    reinforce_token_loss,
    score_centering_term,
    score_centering_weights,
)
from support_replay.core.support import SupportTable


def random_case(seed: int, rows: int = 12, vocab: int = 50, temperature: float = 0.8):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=gen, dtype=torch.float64) * 2
    lists = [sorted(torch.randperm(vocab, generator=gen)[: int(torch.randint(1, 9, (1,), generator=gen))].tolist())
             for _ in range(rows)]  # fmt: skip
    lists[3] = lists[3][:1]  # a singleton (an inserted token's support)
    support = SupportTable.from_lists(lists)
    ids, valid = support.to_padded()
    targets = torch.tensor([r[int(torch.randint(0, len(r), (1,), generator=gen))] for r in lists])
    # a sampler distribution over each support that differs from the trainer's (a mismatch)
    noisy = logits.gather(1, ids) + 0.3 * torch.randn(ids.shape, generator=gen, dtype=torch.float64)
    logq = support_rows_logprobs(noisy, valid, temperature).detach()
    advantages = torch.randn(rows, generator=gen, dtype=torch.float64)
    return logits, support, ids, valid, targets, logq, advantages, temperature


def reference_gradient(logits, ids, valid, targets, logq, advantages, temperature, mode, cap):
    """A (w_a s_a - sum_v q_v w_v s_v) in float64, by the formula: s_v = (e_v - p_S) / T on the support."""
    grad = torch.zeros_like(logits)
    for t in range(logits.shape[0]):
        row = ids[t][valid[t]]
        z = logits[t, row] / temperature
        p = torch.softmax(z, 0)
        q = torch.exp(logq[t][valid[t]])
        ratio = p / q
        w = {"none": torch.ones_like(p), "ratio": ratio, "tis": ratio.clamp(max=cap),
             "mis": ((ratio >= 1 / cap) & (ratio <= cap)).double()}[mode]  # fmt: skip
        scores = (torch.eye(len(row), dtype=torch.float64) - p[None]) / temperature  # s_v, one row per v
        a = int((row == targets[t]).nonzero())
        g = advantages[t] * (w[a] * scores[a] - (q * w) @ scores)
        grad[t, row] = -g  # the loss is minus the objective
    return grad


@pytest.mark.parametrize("mode", ["none", "ratio", "tis", "mis"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_gradient_is_the_centred_score_in_float64(mode, seed):
    logits, support, ids, valid, targets, logq, adv, temp = random_case(seed)
    logits.requires_grad_(True)
    logp = support_logprobs(logits, targets, support, temp)
    rows = support_rows_logprobs(logits.gather(1, ids), valid, temp)
    log_mu = logq.gather(1, (ids == targets[:, None]).int().argmax(1, keepdim=True)).squeeze(1)
    term, drift = score_centering_term(rows, logq, valid, adv, mode, 1.5)
    loss = reinforce_token_loss(logp, log_mu, adv, mode, 1.5) + term
    loss.sum().backward()
    expected = reference_gradient(logits.detach(), ids, valid, targets, logq, adv, temp, mode, 1.5)
    torch.testing.assert_close(logits.grad, expected, rtol=1e-10, atol=1e-12)
    assert term[3] == 0 and drift[3] == 0  # a singleton support: the term and its gradient are exactly 0


def test_with_penalised_logits_the_gradient_flows_through_the_transform():
    logits, support, ids, valid, targets, logq, adv, temp = random_case(4)
    logits.requires_grad_(True)
    bias = torch.linspace(-1, 1, ids.shape[1], dtype=torch.float64)
    transform = lambda z, ids: z * 0.9 + bias  # noqa: E731  a penalty-like affine map on the support ids
    rows = support_rows_logprobs(transform(logits.gather(1, ids), ids), valid, temp)
    term, _ = score_centering_term(rows, logq, valid, adv, "ratio", 2.0)
    term.sum().backward()
    reference = logits.detach().clone().requires_grad_(True)
    z = transform(reference.gather(1, ids), ids) / temp
    p_rows = torch.log_softmax(z.masked_fill(~valid, float("-inf")), -1).masked_fill(~valid, 0.0)
    coef = torch.exp(logq).masked_fill(~valid, 0) * torch.exp(p_rows.detach() - logq).masked_fill(~valid, 0)
    (adv * (coef * p_rows).sum(-1)).sum().backward()
    torch.testing.assert_close(logits.grad, reference.grad, rtol=1e-10, atol=1e-12)


def test_when_the_sampler_is_the_policy_the_term_cancels_the_score():
    """q = p and w = 1: E_q[s] = 0, so the centring term's logit gradient is q - p sum(q), bounded by
    |1 - sum(q)| max p (0 up to rounding); in fp32, as true-on-policy mode has it."""
    logits, support, ids, valid, targets, _, adv, temp = random_case(5)
    z = logits.float().gather(1, ids).requires_grad_(True)
    rows = support_rows_logprobs(z, valid, temp)
    logq = rows.detach().clone()
    term, drift = score_centering_term(rows, logq, valid, adv.float(), "none", 2.0)
    term.sum().backward()
    q = torch.exp(logq).masked_fill(~valid, 0)
    bound = (1 - q.sum(-1)).abs() * torch.exp(rows.detach()).masked_fill(~valid, 0).max(-1).values / temp
    assert (z.grad.abs().max(-1).values <= bound * adv.abs().float() + 1e-7).all()
    assert float(drift.max()) < 1e-6


@pytest.mark.float_bits
def test_weights_follow_their_definitions():
    logp = torch.log(torch.tensor([0.2, 0.5, 0.05]))
    logq = torch.log(torch.tensor([0.1, 0.5, 0.2]))
    assert torch.allclose(score_centering_weights(logp, logq, "ratio", 1.5), torch.tensor([2.0, 1.0, 0.25]))
    assert torch.allclose(score_centering_weights(logp, logq, "tis", 1.5), torch.tensor([1.5, 1.0, 0.25]))
    assert torch.equal(score_centering_weights(logp, logq, "mis", 1.5), torch.tensor([0.0, 1.0, 0.0]))
    assert torch.equal(score_centering_weights(logp, logq, "none", 1.5), torch.ones(3))
