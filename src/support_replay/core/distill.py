"""On-policy distillation on the replayed support (docs/math.md, "Distillation on the support").

Per model token t, with ``S_t`` the realized support the engine sampled from:

- ``student`` ``[N, K]``: ``log q(v | S_t)``, the student's support-normalised log-probs of every support id
  (``core/logprobs.support_rows_logprobs``: the ratio's own function), with a gradient; 0 at padding.
- ``teacher`` ``[N, K]``: ``log p_T(v)``, the teacher's **full-vocabulary** log-softmax read at the support
  ids, without one; a missing value (NaN or -inf at a valid id) fails the token: no floor, no substitute.
- ``valid`` ``[N, K]``: which columns are support ids.

The forms, exact on ``S_t`` (``|S_t|`` ids a token):

- ``reverse``: ``sum_S q (log q - log p_T)``: what the student minimises; the full reverse KL at top_p = 1
  with no top-k (``S_t`` the vocabulary), and ``KL(q || p_T|S) - log P_T(S_t)`` otherwise.
- ``forward``: ``KL(p_T|S || q)``, the teacher renormalised over ``S_t``.
- ``jsd``: GKD's generalised Jensen-Shannon divergence, ``beta KL(P || M) + (1 - beta) KL(Q || M)``,
  ``M = beta P + (1 - beta) Q``, ``P`` the teacher renormalised over ``S_t`` and ``Q`` the student's ``q``.
- ``single``: the one-sample estimator the field uses, ``log pi(a_t) - log p_T(a_t)`` with the student's
  full-vocabulary score: biased under truncated sampling by ``log Pi(S_t)`` in expectation (docs/math.md).

Everything is fp32 or wider, plain autograd.
"""

from __future__ import annotations

import torch

from ..errors import SampleError

FORMS = ("reverse", "forward", "jsd", "single")


def check_teacher(teacher: torch.Tensor, valid: torch.Tensor, where=None) -> None:
    """Every valid support id has a finite teacher log-prob; otherwise ``SampleError`` naming the first row and
    column without one (``where(row)`` says which sample and position a row is)."""
    bad = valid & ~torch.isfinite(teacher)
    if bool(bad.any()):
        row, col = (int(i) for i in bad.nonzero()[0])
        place = where(row) if where is not None else f"row {row}"
        raise SampleError(
            f"teacher log-probs: {place}, support column {col} has {float(teacher[row, col])}: every id of S_t "
            "needs the teacher's log-prob (the exact divergence has no substitute)"
        )


def _masked_lse(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return torch.logsumexp(x.masked_fill(~valid, float("-inf")), dim=-1)


def teacher_mass(teacher: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``log P_T(S_t)`` per token: the teacher's log mass inside the support."""
    return _masked_lse(teacher, valid)


def _renormalised(teacher: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    return (teacher - teacher_mass(teacher, valid)[:, None]).masked_fill(~valid, 0.0)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``sum_S p (log p - log q)`` per row (``log_p`` normalised on the valid columns)."""
    return torch.where(valid, log_p.exp() * (log_p - log_q), torch.zeros_like(log_p)).sum(-1)


def divergence(
    form: str,
    student: torch.Tensor,
    teacher: torch.Tensor,
    valid: torch.Tensor,
    *,
    beta: float = 0.5,
    student_full: torch.Tensor | None = None,
    selected: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N]`` per-token divergence of ``form`` (``FORMS``). ``single`` needs ``student_full`` ``[N]`` (the
    student's full-vocabulary ``log pi(a_t)``) and ``selected`` ``[N]`` (each token's column in its row)."""
    check_teacher(teacher, valid)
    teacher = teacher.masked_fill(~valid, 0.0).to(student.dtype)
    if form == "reverse":
        return _kl(student, teacher, valid)
    if form == "forward":
        return _kl(_renormalised(teacher, valid), student, valid)
    if form == "jsd":
        if not 0.0 < beta < 1.0:
            raise ValueError(f"jsd: beta={beta} must be in (0, 1)")
        p = _renormalised(teacher, valid)
        m = torch.logaddexp(
            p + torch.log(torch.tensor(beta, dtype=p.dtype)), student + torch.log1p(torch.tensor(-beta, dtype=p.dtype))
        )
        return beta * _kl(p, m, valid) + (1 - beta) * _kl(student, m, valid)
    if form == "single":
        if student_full is None or selected is None:
            raise ValueError("single: needs the student's full-vocabulary log-prob and each token's column")
        return student_full - teacher.gather(1, selected[:, None]).squeeze(1)
    raise ValueError(f"divergence form {form!r}: one of {FORMS}")


def agreement(student: torch.Tensor, teacher: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: the student's and the teacher's most likely id on ``S_t`` are the same."""
    low = torch.finfo(student.dtype).min
    s = student.detach().masked_fill(~valid, low).argmax(-1)
    t = teacher.to(student.dtype).masked_fill(~valid, low).argmax(-1)
    return s == t
