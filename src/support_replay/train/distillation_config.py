"""The on-policy distillation section of the run config (slime's flag names where they fit: ``--use-opd``,
``--opd-kl-coef``, ``--opd-teacher-load``); the math is docs/math.md, "Distillation on the support"."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from ..core.distill import FORMS
from .section_base import Section, bad

DIVERGENCES = tuple(f for f in FORMS if f != "single")


class DistillationConfig(Section):
    """On-policy distillation: a teacher scores the student's tokens."""

    TITLE: ClassVar[str] = "on-policy distillation"

    use_opd: bool = Field(False, description="on-policy distillation: a teacher's divergence on the student's tokens")
    opd_teacher_load: str | None = Field(
        None,
        description="the teacher: a causal LM checkpoint with the student's tokenizer and vocabulary, loaded beside "
        "the actor and never trained",
    )
    opd_teacher_url: str | None = Field(
        None,
        description="the teacher served by support-replay serve (its /score_support route), instead of "
        "--opd-teacher-load",
    )
    opd_kl_coef: float = Field(1.0, gt=0, description="weight of the teacher's divergence")
    opd_estimator: Literal["exact", "single"] = Field(
        "exact",
        description="exact: the divergence over each token's replayed support S_t, its gradient added to the loss; "
        "single: slime's one-sample reverse KL, log pi(a_t) - log p_T(a_t) with the student's full-vocabulary "
        "log-prob, subtracted from each token's advantage (biased low under truncated sampling)",
    )
    opd_divergence: Literal[DIVERGENCES] = Field(
        "reverse", description="the exact form's divergence on S_t: reverse KL, forward KL, or GKD's generalised JSD"
    )
    opd_jsd_beta: float = Field(0.5, gt=0, lt=1, description="GKD's beta of --opd-divergence jsd")
    opd_only: bool = Field(False, description="distillation alone: the reward's advantage left out of the loss")

    @model_validator(mode="after")
    def _check(self):
        defaults = type(self).model_fields
        if not self.use_opd:
            names = (
                "opd_teacher_load",
                "opd_teacher_url",
                "opd_kl_coef",
                "opd_estimator",
                "opd_divergence",
                "opd_only",
            )
            for name in names:
                if getattr(self, name) != defaults[name].default:
                    bad(name, getattr(self, name), "has no effect without --use-opd")
        elif not self.opd_teacher_load and not self.opd_teacher_url:
            bad("opd_teacher_load", None, "--use-opd needs a teacher: its checkpoint's directory or --opd-teacher-url")
        elif self.opd_teacher_load and self.opd_teacher_url:
            bad("opd_teacher_url", self.opd_teacher_url, f"and --opd-teacher-load={self.opd_teacher_load!r}: give one")
        if self.opd_estimator == "single" and self.opd_divergence != "reverse":
            bad("opd_divergence", self.opd_divergence, "the single-sample estimator is of the reverse KL alone")
        if self.opd_jsd_beta != defaults["opd_jsd_beta"].default and self.opd_divergence != "jsd":
            bad("opd_jsd_beta", self.opd_jsd_beta, "is read by --opd-divergence jsd only")
        return self


def check_distillation(opd: DistillationConfig, rollout, parallel, optimizer) -> None:
    """The rules joining sections: distillation reads the replayed support, a teacher beside each unsharded actor
    rank, and the PPO advantage (its single-sample form)."""
    if not opd.use_opd:
        return
    if not rollout.use_sampling_support_replay:
        bad(
            "use_opd",
            True,
            "scores the teacher on each token's replayed support, which only replay captures (rollout top_p < 1, "
            "top_k > 0 or min_p > 0); the full-vocabulary divergence is not built",
        )
    if opd.opd_teacher_url and opd.opd_estimator == "exact" and rollout.rollout_top_k <= 0:
        bad(
            "opd_teacher_url",
            opd.opd_teacher_url,
            "the exact divergence over HTTP sends every support id of every token: it needs a bounded support "
            "(--rollout-top-k > 0), or an in-process teacher (--opd-teacher-load)",
        )
    for name in ("tensor_model_parallel_size", "context_parallel_size"):
        size = getattr(parallel, name)
        if size > 1:
            bad(name, size, "with --use-opd: the teacher scores whole rows on each rank (not sharded yet)")
    if opd.opd_estimator == "single" and optimizer.policy_loss == "reinforce":
        bad("opd_estimator", "single", "shapes the PPO advantage per token; --policy-loss reinforce is not built")
