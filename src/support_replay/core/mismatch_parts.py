"""The training-inference log-ratio of every token, split by cause, and the evidence of how each
captured support was filtered, read at the trainer's logits (docs/audit.md).

    log pi_full(a) - log mu(a) = [log pi_full(a) - log pi_S(a)]        truncation: log Z_S <= 0
                               + [log pi_S(a) - log pi'_S(a)]          penalties and logit bias
                               + [log pi'_S(a) - log mu(a)]            numerics: trainer vs engine

``pi_S`` is the trainer's softmax over the captured support of the raw logits, ``pi'_S`` the same on
the penalised ones (the replay the trainer would run). The three parts add up to the whole ratio by
construction. Everything here takes tensors and plain arguments.
"""

from __future__ import annotations

import math

import torch

from .logprobs import _masked_logsumexp, full_logprobs, penalised_support_logprobs, support_logprobs
from .sampling import SamplingParams, support_mask


def ratio_parts(logits, targets, ids, valid, temperature: float, transform=None) -> dict[str, torch.Tensor]:
    """``[N]`` fp32 scores of the targets at ``logits`` ``[N, V]``: ``full`` over the vocabulary,
    ``support`` over the padded support ``(ids, valid)`` ``[N, K]`` and ``penalised`` (its
    ``transform``, or equal to ``support`` without one); ``support_logits`` ``[N, K]`` the
    (penalised) logits at the support ids and ``column`` the target's place in its row, for the
    temperature fit."""
    full = full_logprobs(logits, targets, temperature)
    support = support_logprobs(logits, targets, (ids, valid), temperature)
    penalised = (
        support
        if transform is None
        else penalised_support_logprobs(logits, targets, (ids, valid), temperature, transform)
    )
    z = logits.gather(1, ids).float()
    if transform is not None:
        z = transform(z, ids)
    column = ((ids == targets[:, None]) & valid).to(torch.uint8).argmax(-1)
    return {"full": full, "support": support, "penalised": penalised, "support_logits": z, "column": column}


def filter_evidence(logits, ids, valid, params: SamplingParams, semantics: str) -> dict[str, torch.Tensor]:
    """How each captured support sits against the declared filters at ``logits`` ``[N, V]``.

    Ids are ranked by the trainer's probability ``p = softmax(z/T)``; the top-p measure is the
    exclusive prefix mass in that order, of ``p`` itself (SGLang's joint rule) or of ``p``
    renormalised over what min-p and top-k keep (vLLM's and Hugging Face's sequential rule).
    Returns ``[N]`` tensors: ``observed`` and ``expected`` sizes (the support the declared
    settings give at these logits), ``common`` ids, ``kept_mass`` / ``kept_ratio`` / ``kept_rank``
    (the largest measure, smallest ``p / p_max`` and largest rank of a kept id), and the same of
    ``first_out``, the most probable id left out (``first_out_rank`` -1 when none is), with
    ``first_out_expected`` whether the declared settings keep it.
    """
    z = logits.float() / params.temperature
    p = torch.softmax(z, dim=-1)
    p_sort, order = torch.sort(p, dim=-1, descending=True, stable=True)
    rows, vocab = p.shape
    ranks = torch.arange(vocab, device=p.device).expand(rows, vocab)
    # summed, not assigned: padding entries may repeat a kept id
    observed_mask = torch.zeros_like(p, dtype=torch.int32).scatter_add_(1, ids, valid.to(torch.int32)) > 0
    expected_mask = support_mask(logits.float(), params, semantics)
    in_s = observed_mask.gather(1, order)
    in_e = expected_mask.gather(1, order)
    ratio = p_sort / p_sort[:, :1]
    if semantics == "sglang":
        measured = p_sort
    else:
        k = params.top_k if params.top_k > 0 else vocab
        kept = (ranks < k) & (ratio >= params.min_p)
        measured = torch.where(kept, p_sort, torch.zeros_like(p_sort))
        measured = measured / measured.sum(-1, keepdim=True)
    mass = measured.cumsum(-1) - measured
    inf = torch.full_like(mass, math.inf)
    out = {
        "observed": in_s.sum(-1),
        "expected": in_e.sum(-1),
        "common": (in_s & in_e).sum(-1),
        "kept_mass": torch.where(in_s, mass, -inf).amax(-1),
        "kept_ratio": torch.where(in_s, ratio, inf).amin(-1),
        "kept_rank": torch.where(in_s, ranks, -1).amax(-1),
    }
    left_out = ~in_s
    has_out = left_out.any(-1)
    first = left_out.to(torch.uint8).argmax(-1)
    pick = first[:, None]
    out["first_out_rank"] = torch.where(has_out, first, -1)
    out["first_out_mass"] = torch.where(has_out, mass.gather(1, pick).squeeze(1), inf[:, 0])
    out["first_out_ratio"] = torch.where(has_out, ratio.gather(1, pick).squeeze(1), -inf[:, 0])
    out["first_out_expected"] = has_out & in_e.gather(1, pick).squeeze(1)
    return out


def temperature_residual(z, valid, column, log_mu, temperature: float) -> torch.Tensor:
    """``[N]`` ``log mu - log softmax_S(z / T)[target]`` at temperature ``T`` (float64)."""
    scaled = z.double() / temperature
    lse, _ = _masked_logsumexp(scaled, valid)
    return log_mu.double() - (scaled.gather(1, column[:, None]).squeeze(1) - lse)


def fit_temperature(z, valid, column, log_mu, low: float = 0.05, high: float = 20.0, steps: int = 80) -> float:
    """The temperature that best reproduces ``log mu`` on the supports (least squares over the rows
    with two ids or more; golden-section search on log T). NaN when no row has two ids."""
    informative = valid.sum(-1) >= 2
    if not bool(informative.any()):
        return math.nan
    z, valid, column, log_mu = z[informative], valid[informative], column[informative], log_mu[informative]

    def loss(log_t: float) -> float:
        return float(temperature_residual(z, valid, column, log_mu, math.exp(log_t)).pow(2).sum())

    a, b = math.log(low), math.log(high)
    golden = (math.sqrt(5) - 1) / 2
    c, d = b - golden * (b - a), a + golden * (b - a)
    fc, fd = loss(c), loss(d)
    for _ in range(steps):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - golden * (b - a)
            fc = loss(c)
        else:
            a, c, fc = c, d, fd
            d = a + golden * (b - a)
            fd = loss(d)
    return math.exp((a + b) / 2)
