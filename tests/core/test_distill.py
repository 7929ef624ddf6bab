"""core/distill.py against a dense float64 reference on random logits: every form's value and gradient, the
single-sample estimator's bias under truncated sampling, and the refusal of a support id without a teacher
log-prob."""

from __future__ import annotations

import pytest
import torch

from support_replay.core.distill import FORMS, agreement, divergence, teacher_mass
from support_replay.core.logprobs import support_rows_logprobs
from support_replay.errors import SampleError

V, N = 40, 7


def random_case(seed: int, full_support: bool = False):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(N, V, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
    zt = torch.randn(N, V, generator=g, dtype=torch.float64) * 2
    supports = []
    for _ in range(N):
        k = V if full_support else int(torch.randint(1, 12, (1,), generator=g))
        supports.append(torch.randperm(V, generator=g)[:k].sort().values)
    width = max(len(s) for s in supports)
    ids = torch.zeros(N, width, dtype=torch.long)
    valid = torch.zeros(N, width, dtype=torch.bool)
    for i, s in enumerate(supports):
        ids[i, : len(s)], valid[i, : len(s)] = s, True
    selected = torch.tensor([int(torch.randint(0, len(s), (1,), generator=g)) for s in supports])
    return z, zt, supports, ids, valid, selected


def ours(form, z, zt, ids, valid, selected, beta=0.3):
    student = support_rows_logprobs(z.gather(1, ids), valid)
    teacher = torch.log_softmax(zt, -1).gather(1, ids).masked_fill(~valid, float("nan"))
    full = torch.log_softmax(z, -1).gather(1, ids.gather(1, selected[:, None])).squeeze(1)
    return divergence(form, student, teacher, valid, beta=beta, student_full=full, selected=selected)


def reference(form, z, zt, supports, selected, beta=0.3):
    """Row by row over the support's ids, in float64, from the definitions in docs/math.md."""
    out = []
    for i, s in enumerate(supports):
        log_pi = torch.log_softmax(z[i], -1)
        log_q = log_pi[s] - torch.logsumexp(log_pi[s], 0)
        log_t = torch.log_softmax(zt[i], -1)[s]
        log_tn = log_t - torch.logsumexp(log_t, 0)
        q, tn = log_q.exp(), log_tn.exp()
        if form == "reverse":
            out.append((q * (log_q - log_t)).sum())
        elif form == "forward":
            out.append((tn * (log_tn - log_q)).sum())
        elif form == "jsd":
            m = beta * tn + (1 - beta) * q
            out.append(beta * (tn * (log_tn - m.log())).sum() + (1 - beta) * (q * (log_q - m.log())).sum())
        else:
            a = s[selected[i]]
            out.append(log_pi[a] - torch.log_softmax(zt[i], -1)[a])
    return torch.stack(out)


@pytest.mark.float_bits
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_form_equals_its_float64_reference_in_value_and_gradient(form, seed):
    z, zt, supports, ids, valid, selected = random_case(seed)
    got = ours(form, z, zt, ids, valid, selected)
    (grad,) = torch.autograd.grad(got.sum(), z)
    want = reference(form, z, zt, supports, selected)
    (want_grad,) = torch.autograd.grad(want.sum(), z)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.float_bits
def test_the_reverse_form_on_the_whole_vocabulary_is_the_full_reverse_kl():
    z, zt, _, ids, valid, selected = random_case(3, full_support=True)
    full_kl = torch.nn.functional.kl_div(
        torch.log_softmax(zt, -1), torch.log_softmax(z, -1), log_target=True, reduction="none"
    ).sum(-1)
    torch.testing.assert_close(ours("reverse", z, zt, ids, valid, selected), full_kl, rtol=1e-12, atol=1e-12)
    assert torch.allclose(teacher_mass(torch.log_softmax(zt, -1).gather(1, ids), valid), torch.zeros(N, dtype=zt.dtype))


@pytest.mark.float_bits
def test_the_single_sample_estimator_is_biased_by_the_students_log_mass_outside_the_support():
    """E_{a ~ q}[log pi(a) - log p_T(a)] = reverse + log Pi(S_t): low by the log of the student's mass on S_t."""
    z, zt, supports, ids, valid, _ = random_case(4)
    student = support_rows_logprobs(z.detach().gather(1, ids), valid)
    teacher = torch.log_softmax(zt, -1).gather(1, ids)
    exact = divergence("reverse", student, teacher, valid)
    log_pi = torch.log_softmax(z.detach(), -1).gather(1, ids)
    expected_single = torch.where(valid, student.exp() * (log_pi - teacher), torch.zeros_like(student)).sum(-1)
    mass = torch.logsumexp(log_pi.masked_fill(~valid, float("-inf")), -1)
    torch.testing.assert_close(expected_single, exact + mass, rtol=1e-12, atol=1e-12)
    assert bool((mass < 0).all())  # truncated supports: the estimator is biased low


@pytest.mark.parametrize("bad", [float("nan"), float("-inf")])
def test_a_support_id_without_a_teacher_log_prob_fails_the_token_by_name(bad):
    z, zt, _, ids, valid, selected = random_case(5)
    student = support_rows_logprobs(z.gather(1, ids), valid)
    teacher = torch.log_softmax(zt, -1).gather(1, ids)
    teacher[2, 0] = bad
    with pytest.raises(SampleError, match="row 2, support column 0"):
        divergence("reverse", student, teacher, valid)


def test_agreement_is_the_same_most_likely_id_on_the_support():
    valid = torch.tensor([[True, True, False], [True, True, True]])
    student = torch.tensor([[-0.1, -2.0, 0.0], [-3.0, -0.2, -2.0]])
    teacher = torch.tensor([[-0.5, -1.0, 9.0], [-0.1, -4.0, -5.0]])
    assert agreement(student, teacher, valid).tolist() == [True, False]
