"""Policy-gradient losses, KL estimators and replay metrics (docs/math.md).

Per-token tensors are padded ``[B, L]`` with a loss mask ``[B, L]`` (1 for tokens that
train, 0 for prompt, padding and inserted environment/tool tokens). Under replay the
policy ratio uses support-normalised scores, while KL and entropy use full-vocabulary
ones: the two are separate arguments, never one slot.
"""

from __future__ import annotations

import numpy as np
import torch

from .errors import SupportReplayError

AGGREGATIONS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3")


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token") -> torch.Tensor:
    """Masked mean: over all tokens (``"token"``) or per sequence then over sequences (``"sequence"``).

    Sequences without a single trained token are left out of the ``"sequence"`` mean.
    """
    mask = mask.to(values.dtype)
    if mode == "token":
        return (values * mask).sum() / mask.sum().clamp_min(1)
    if mode == "sequence":
        counts = mask.sum(-1)
        per_seq = (values * mask).sum(-1) / counts.clamp_min(1)
        present = (counts > 0).to(values.dtype)
        return (per_seq * present).sum() / present.sum().clamp_min(1)
    raise SupportReplayError(f"aggregation: must be one of {AGGREGATIONS}, got {mode!r}")


def grpo_advantages(rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6) -> torch.Tensor:
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
    logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, clip_low: float = 0.2, clip_high: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token ``-min(r A, clip(r, 1-lo, 1+hi) A)`` and whether the clipped branch was taken."""
    clip_high = clip_low if clip_high is None else clip_high
    ratio = torch.exp(logp - old_logp)
    surr = ratio * advantages
    surr_clipped = torch.clamp(ratio, 1 - clip_low, 1 + clip_high) * advantages
    return -torch.minimum(surr, surr_clipped), (surr_clipped < surr).detach()


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    aggregation: str = "token",
    importance_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate ``-min(r A, clip(r, 1-lo, 1+hi) A)`` with ``r = exp(logp - old_logp)``.

    Under replay ``logp`` and ``old_logp`` are support-normalised scores on the same S_t.
    ``advantages`` is ``[B]`` (one per sequence) or ``[B, L]``. ``importance_weights``
    (``[B, L]``, e.g. truncated IS against the rollout log mu) multiply the per-token loss.
    """
    if advantages.ndim == 1:
        advantages = advantages[:, None].expand_as(logp)
    per_token, clipped = ppo_token_loss(logp, old_logp, advantages, clip_low, clip_high)
    if importance_weights is not None:
        per_token = per_token * importance_weights.detach()
    loss = aggregate(per_token, mask, aggregation)
    with torch.no_grad():
        m = mask.bool()
        ratio = torch.exp(logp - old_logp)
        metrics = {
            "clip_fraction": float((clipped & m).sum() / m.sum().clamp_min(1)),
            "ratio_mean": float(ratio[m].mean()) if m.any() else 1.0,
            "ratio_max": float(ratio[m].max()) if m.any() else 1.0,
        }
    return loss, metrics


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


def logprob_mismatch_metrics(trainer_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the trainer's scores are from the rollout's log mu on the trained tokens.

    ``abs_diff_max/mean``, ``mismatch_kl`` (k3 estimate of KL(mu || pi), sampled from mu),
    ``ratio_mean`` of pi/mu and the share of tokens whose ratio is outside [0.9, 1.1].
    """
    m = mask.bool()
    if not m.any():
        return {"abs_diff_max": 0.0, "abs_diff_mean": 0.0, "mismatch_kl": 0.0, "ratio_mean": 1.0, "ratio_outside_10pct": 0.0}
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
        return {"support_mean": 0.0, "support_median": 0.0, "support_p99": 0.0, "support_max": 0.0, "singleton_share": 0.0}
    return {
        "support_mean": float(sizes.mean()),
        "support_median": float(np.median(sizes)),
        "support_p99": float(np.percentile(sizes, 99)),
        "support_max": float(sizes.max()),
        "singleton_share": float(np.mean(sizes == 1)),
    }
