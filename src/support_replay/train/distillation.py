"""What on-policy distillation adds to a micro-batch's loss (docs/math.md, "Distillation on the support"):

- ``exact``: ``coef x D(t)`` per token, ``D`` the chosen divergence over the token's replayed support between
  the student's support-normalised log-probs (with their gradient) and the teacher's full-vocabulary ones;
- ``single``: slime's advantage shaping, ``A_t - coef x (log pi_old(a_t) - log p_T(a_t))``, the student's
  full-vocabulary log-prob of the old policy;
- ``--opd-only``: the reward's advantage left out, distillation alone.

Both forms measure both estimates, so a run reports the exact divergence beside the one-sample estimate the
field uses, and the teacher's mass inside each support.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.distill import agreement, check_teacher, divergence, teacher_mass
from .batches import MicroBatch
from .distillation_config import DistillationConfig
from .teacher import TeacherScores


@dataclass
class DistillSums:
    """Sums over a micro-batch's trained tokens: the divergence and the one-sample estimate (and squares), the
    teacher's mass inside S_t, the tokens where student and teacher agree on the most likely id of S_t."""

    exact: float = 0.0
    exact_sq: float = 0.0
    single: float = 0.0
    single_sq: float = 0.0
    mass: float = 0.0
    agree: float = 0.0


@dataclass
class DistillTerms:
    loss: torch.Tensor | None  # [N] added to the loss per token (exact), else None
    advantages: torch.Tensor  # [N] the token advantages the policy term uses
    sums: DistillSums


def where_in(batch: MicroBatch):
    """``row -> "sample i, response position p"`` for a micro-batch's flat rows."""
    ends = torch.cumsum(torch.tensor(batch.lengths), 0)

    def place(row: int) -> str:
        k = int((ends <= row).sum())
        return f"sample {batch.indices[k]}, response position {row - int(ends[k - 1] if k else 0)}"

    return place


def distill_terms(
    cfg: DistillationConfig,
    batch: MicroBatch,
    student_rows: torch.Tensor,
    student_full_old: torch.Tensor,
    teacher: TeacherScores,
    token_advantages: torch.Tensor,
) -> DistillTerms:
    """``student_rows`` ``[N, K]`` log q(v | S_t) with the gradient; ``student_full_old`` ``[N]`` the old
    policy's full-vocabulary log pi(a_t), detached."""
    rows, selected = teacher.rows(batch)
    ids, valid = batch.support
    check_teacher(rows.masked_fill(~valid, 0.0), valid, where_in(batch))
    single = student_full_old - selected
    exact = divergence(cfg.opd_divergence, student_rows, rows, valid, beta=cfg.opd_jsd_beta)
    advantages = torch.zeros_like(token_advantages) if cfg.opd_only else token_advantages
    loss = None
    if cfg.opd_estimator == "exact":
        loss = cfg.opd_kl_coef * exact
    else:
        advantages = advantages - cfg.opd_kl_coef * single
    mask = batch.loss_mask.to(student_rows.device)
    with torch.no_grad():
        e, s = exact.detach() * mask, single * mask
        sums = DistillSums(
            exact=float(e.sum()),
            exact_sq=float((e * e).sum()),
            single=float(s.sum()),
            single_sq=float((s * s).sum()),
            mass=float((teacher_mass(rows, valid).exp() * mask).sum()),
            agree=float((agreement(student_rows, rows, valid).float() * mask).sum()),
        )
    return DistillTerms(loss, advantages, sums)


def distill_metrics(sums: DistillSums, tokens: float, divergence: str = "reverse") -> dict:
    """Per trained token: ``opd_divergence`` (exact, on S_t) and its variance, ``opd_single_estimate`` (the
    one-sample estimate of the reverse KL) and its variance, their difference ``opd_single_bias`` (the reverse
    form only: the estimate's bias, log Pi(S_t) in expectation), ``opd_teacher_mass`` (the teacher's mass inside
    S_t) and ``opd_agreement``."""
    n = max(tokens, 1.0)
    exact, single = sums.exact / n, sums.single / n
    bias = {"opd_single_bias": single - exact} if divergence == "reverse" else {}
    return {
        **bias,
        "opd_divergence": exact,
        "opd_divergence_var": sums.exact_sq / n - exact * exact,
        "opd_single_estimate": single,
        "opd_single_var": sums.single_sq / n - single * single,
        "opd_teacher_mass": sums.mass / n,
        "opd_agreement": sums.agree / n,
    }
