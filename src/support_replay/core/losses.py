"""Policy-gradient losses, KL estimators and replay metrics (docs/math.md).

Per-token tensors come with a loss mask (1 for tokens that train, 0 for prompt, padding
and inserted environment/tool tokens). Under replay the policy ratio uses
support-normalised scores, while KL and entropy use full-vocabulary ones: the two are
separate arguments, never one slot. ``token_weights`` is the one place where tokens and
sequences are weighted into a loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import SupportReplayError

AGGREGATIONS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")


def token_weights(
    mask: torch.Tensor, lengths, mode: str, *, batch_tokens: float, batch_sequences: float
) -> torch.Tensor:
    """Per-token weights of a loss, the one place where tokens and sequences are weighted.

    ``mask`` is the flat loss mask of some sequences (``lengths`` tokens each), part of a
    batch holding ``batch_tokens`` trained tokens in ``batch_sequences`` sequences that
    train at all. Summing ``weights * values`` over every part of the batch gives:

    - ``"token"``: the mean over all trained tokens of the batch;
    - ``"sequence"``: the mean over sequences of each sequence's mean over its trained
      tokens (sequences without a trained token are left out).

    So micro-batching and data parallelism never change the loss.
    """
    mask = mask.to(torch.float32)
    if mode == "token":
        return mask / max(float(batch_tokens), 1.0)
    if mode == "sequence":
        lengths = torch.as_tensor(list(lengths), dtype=torch.long, device=mask.device)
        counts = (
            torch.stack([m.sum() for m in torch.split(mask, lengths.tolist())]) if len(lengths) else mask.new_zeros(0)
        )
        per_token_count = torch.repeat_interleave(counts.clamp_min(1), lengths)
        return mask / per_token_count / max(float(batch_sequences), 1.0)
    raise SupportReplayError(f"aggregation: must be one of {AGGREGATIONS}, got {mode!r}")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token") -> torch.Tensor:
    """Masked mean of padded ``[B, L]`` values over one whole batch (``token_weights``' rule)."""
    rows, width = mask.shape
    weights = token_weights(
        mask.reshape(-1),
        [width] * rows,
        mode,
        batch_tokens=float(mask.sum()),
        batch_sequences=float((mask.sum(-1) > 0).sum()),
    )
    return (values.reshape(-1) * weights.to(values.dtype)).sum()


def grpo_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """GRPO: each reward minus its group's mean (optionally over the group's std).

    ``rewards`` ``[N]`` ordered group by group (``N % group_size == 0``).
    """
    if group_size < 1 or rewards.numel() % group_size:
        raise SupportReplayError(f"group_size: {rewards.numel()} rewards do not split into groups of {group_size}")
    groups = rewards.reshape(-1, group_size).to(torch.float32)
    centered = groups - groups.mean(-1, keepdim=True)
    if normalize_std:
        std = groups.std(-1, unbiased=True, keepdim=True) if group_size > 1 else torch.zeros_like(groups[:, :1])
        centered = centered / (std + eps)
    return centered.reshape(-1)


def ppo_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``-min(r A, clip(r, 1-lo, 1+hi) A)`` and whether the clipped branch was taken."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(logp - old_logp)
    surr = ratio * advantages
    surr_clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(surr, surr_clipped), (surr_clipped < surr).detach()


@dataclass
class TokenLoss:
    """The per-token loss of one micro-batch and the parts the metrics report."""

    total: torch.Tensor  # the loss of every token, before weighting
    clipped: torch.Tensor  # bool: the clipped branch of the PPO surrogate was taken
    kl: torch.Tensor | None
    entropy: torch.Tensor | None


def policy_token_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    importance_weights: torch.Tensor | None = None,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    reinforce: tuple[torch.Tensor, str, float] | None = None,
    centering: torch.Tensor | None = None,
) -> TokenLoss:
    """``-min(r A, clip(r, 1-lo, 1+hi) A) * w + kl_coef * KL - entropy_coef * H`` per token.

    ``r = exp(logp - old_logp)``: under replay both are support-normalised scores on the
    same S_t. ``importance_weights`` (e.g. truncated IS against the rollout log mu) are
    detached; ``kl`` and ``entropy`` come from full-vocabulary scores. ``reinforce`` (the
    sampler's log mu, the weight's mode and cap) takes ``-A sg(w_a) log pi(a)`` instead of the
    clipped surrogate; ``centering`` (``score_centering_term``) is added to it. Weight the result
    with ``token_weights``.
    """
    if reinforce is not None:
        sampler_logp, mode, cap = reinforce
        total = reinforce_token_loss(logp, sampler_logp, advantages, mode, cap)
        clipped = torch.zeros_like(total, dtype=torch.bool)
    else:
        total, clipped = ppo_token_loss(logp, old_logp, advantages, clip_low, clip_high)
    if centering is not None:
        total = total + centering
    if importance_weights is not None:
        total = total * importance_weights.detach()
    if kl is not None:
        total = total + kl_coef * kl
    if entropy is not None:
        total = total - entropy_coef * entropy
    return TokenLoss(total=total, clipped=clipped, kl=kl, entropy=entropy)


SC_WEIGHTS = ("none", "ratio", "tis", "mis")


def score_centering_weights(logp: torch.Tensor, logq: torch.Tensor, mode: str, cap: float) -> torch.Tensor:
    """``w = f(p / q)`` (detached) of score centering and the REINFORCE loss (docs/math.md, "score centering"):
    ``none`` 1; ``ratio`` p/q; ``tis`` min(p/q, cap); ``mis`` 1 where p/q lies in [1/cap, cap], else 0."""
    if mode not in SC_WEIGHTS:
        raise SupportReplayError(f"score_centering_weight: must be one of {SC_WEIGHTS}, got {mode!r}")
    if mode == "none":
        return torch.ones_like(logp)
    ratio = torch.exp(logp.detach() - logq.detach())
    if mode == "ratio":
        return ratio
    if mode == "tis":
        return ratio.clamp(max=cap)
    return ((ratio >= 1.0 / cap) & (ratio <= cap)).to(ratio.dtype)


def reinforce_token_loss(logp: torch.Tensor, log_mu: torch.Tensor, advantages: torch.Tensor, mode: str, cap: float):
    """Per-token ``-A * sg(w_a) * log pi(a)``: the importance-weighted policy gradient, no clipping."""
    return -advantages * score_centering_weights(logp, log_mu, mode, cap) * logp


def score_centering_term(
    support_logp: torch.Tensor,
    sampler_logq: torch.Tensor,
    valid: torch.Tensor,
    advantages: torch.Tensor,
    mode: str,
    cap: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(+A * sum_v sg(q_v w_v) log pi(v), drift)`` per token over the support (padded ``[T, K]``).

    Added to ``-A sg(w_a) log pi(a)`` its gradient is ``A (w_a s_a - sum_v q_v w_v s_v)``: the sampler-
    expected score is subtracted, exactly, on the recorded support. ``drift`` is the L1 norm of the removed
    term's gradient on the scaled support logits z/T per unit advantage, ``sum_v |q_v w_v - p_v sum_u q_u w_u|``:
    what the uncentred loss pulls toward the sampler with."""
    q = torch.exp(sampler_logq).masked_fill(~valid, 0.0)
    w = score_centering_weights(support_logp, sampler_logq, mode, cap).masked_fill(~valid, 0.0)
    coef = (q * w).detach()
    term = advantages * (coef * support_logp).sum(-1)
    with torch.no_grad():
        p = torch.exp(support_logp).masked_fill(~valid, 0.0)
        drift = (coef - p * coef.sum(-1, keepdim=True)).abs().sum(-1)
    return term, drift


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from samples of pi (Schulman's k1, k2, k3).

    Both arguments are full-vocabulary scores of the sampled tokens.
    """
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    if kind == "k3":
        return torch.exp(-log_ratio) + log_ratio - 1
    raise SupportReplayError(f"kl estimator: must be one of {KL_ESTIMATORS}, got {kind!r}")


def truncated_importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """``min(pi_old / mu, cap)``, detached: corrects residual engine/trainer mismatch (TIS)."""
    if cap <= 0:
        raise SupportReplayError(f"tis cap: must be > 0, got {cap}")
    return torch.exp(old_logp - rollout_logp).clamp(max=cap).detach()


def masked_importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float = 2.0) -> torch.Tensor:
    """1 where ``pi_old / mu`` lies in ``[1/cap, cap]``, else 0, detached (masked IS): a token the
    behaviour policy and the old policy disagree on too much is left out instead of down-weighted."""
    if cap <= 1:
        raise SupportReplayError(f"masked importance sampling cap: must be > 1, got {cap}")
    log_ratio = (old_logp - rollout_logp).detach()
    return (log_ratio.abs() <= math.log(cap)).to(old_logp.dtype)


def importance_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mode: str, cap: float) -> torch.Tensor:
    """The ``--use-tis`` weights: ``"truncate"`` (TIS) or ``"mask"`` (masked IS)."""
    if mode == "truncate":
        return truncated_importance_weights(old_logp, rollout_logp, cap)
    if mode == "mask":
        return masked_importance_weights(old_logp, rollout_logp, cap)
    raise SupportReplayError(f"importance sampling mode: one of ('truncate', 'mask'), got {mode!r}")


def support_mass(full_logp: torch.Tensor, support_logp: torch.Tensor) -> torch.Tensor:
    """Per token, the probability mass the policy puts inside the support: ``Z_S / Z_V``.

    Both scores are of the same token under the same logits and temperature, the one
    normalised over the vocabulary and the other over the support, so their difference is
    ``logsumexp_S - logsumexp_V``: no extra pass over the vocabulary.
    """
    return torch.exp((full_logp - support_logp).clamp(max=0.0))


def logprob_mismatch_metrics(
    trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    """How far the trainer's scores are from the rollout's log mu on the trained tokens.

    ``abs_diff_max/mean``, ``mismatch_kl`` (k3 estimate of KL(mu || pi), sampled from mu),
    ``ratio_mean`` of pi/mu and the share of tokens whose ratio is outside [0.9, 1.1].
    """
    m = mask.bool()
    if not m.any():
        return {
            "abs_diff_max": 0.0,
            "abs_diff_mean": 0.0,
            "mismatch_kl": 0.0,
            "ratio_mean": 1.0,
            "ratio_outside_10pct": 0.0,
        }
    diff = (trainer_logp - rollout_logp)[m].double()
    ratio = torch.exp(diff)
    return {
        "abs_diff_max": float(diff.abs().max()),
        "abs_diff_mean": float(diff.abs().mean()),
        "mismatch_kl": float((ratio - diff - 1).mean()),
        "ratio_mean": float(ratio.mean()),
        "ratio_outside_10pct": float(((ratio < 0.9) | (ratio > 1.1)).double().mean()),
    }


def support_size_metrics(sizes) -> dict[str, float]:
    """Mean, median, p99, max of |S_t| and the share of singleton supports."""
    sizes = np.asarray(sizes, dtype=np.int64)
    if not len(sizes):
        return {
            "support_mean": 0.0,
            "support_median": 0.0,
            "support_p99": 0.0,
            "support_max": 0.0,
            "singleton_share": 0.0,
        }
    return {
        "support_mean": float(sizes.mean()),
        "support_median": float(np.median(sizes)),
        "support_p99": float(np.percentile(sizes, 99)),
        "support_max": float(sizes.max()),
        "singleton_share": float(np.mean(sizes == 1)),
    }
