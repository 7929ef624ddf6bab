"""Log-probabilities of the actor: on the replayed support, on the full vocabulary, entropy.

Math in docs/math.md. ``support_logprobs`` is the one function that both the engine
(log mu, when it samples) and the trainer (log pi, when it scores) call, so equal logits
give equal log-probs bit for bit. Its reduction over the support is a cumulative sum
whose last entry is read: the sum of a row then does not depend on how many padding
columns follow it, so the result does not depend on the batch it was computed in.
"""

from __future__ import annotations

import torch

from ..errors import SupportError
from .support import SupportTable

DEFAULT_CHUNK_ROWS = 1024  # an accelerator's chunk of full-vocabulary rows
# On a CPU a chunk's temporaries ([rows, V] in the accumulation dtype) stay within this many bytes, so each pass over
# them runs from the caches instead of memory: with SmolLM2's 49152 ids, 21 rows instead of 1024, and the full
# log-probs and entropy of 560 rows forward and backward in 0.33 s instead of 0.72 (bench/full_vocab.py).
CPU_CHUNK_BYTES = 4 << 20


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: fp32 for half precisions and fp32, fp64 for fp64 input."""
    return torch.promote_types(dtype, torch.float32)


def _padded(support, device) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(support, SupportTable):
        return support.to_padded(device=device)
    ids, valid = support
    return ids.to(device=device, dtype=torch.long), valid.to(device=device, dtype=torch.bool)


def _temperature_column(temperature, rows: int, device, dtype=torch.float32) -> torch.Tensor:
    """Temperature as a ``[T, 1]`` column (a scalar, or one value per row)."""
    temp = torch.as_tensor(temperature, dtype=dtype, device=device)
    if temp.ndim == 0:
        temp = temp.expand(rows)
    if temp.shape != (rows,):
        raise SupportError(f"temperature: expected a scalar or {rows} values, got shape {tuple(temp.shape)}")
    if not bool((temp > 0).all()):
        raise SupportError(f"temperature: must be > 0 to score log-probs, got {temp.min().item()}")
    return temp.reshape(rows, 1)


def _masked_logsumexp(
    z: torch.Tensor, valid: torch.Tensor, softmax: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(lse[T], softmax[T, K])`` of ``z`` over the valid entries of every row (the softmax None where not
    ``softmax``: the same lse, one operation fewer).

    The sum is read off a cumulative sum, so trailing padding adds exact zeros and the
    value is independent of the padded width.
    """
    z = z.masked_fill(~valid, float("-inf"))
    m = z.max(dim=-1, keepdim=True).values
    e = torch.exp(z - m)
    s = e.cumsum(dim=-1)[:, -1:]
    return (m + torch.log(s)).squeeze(-1), (e / s if softmax else None)


def _support_logprobs(logits, targets, ids, valid, temp, softmax: bool = True):
    """``(log pi [T], softmax over the support [T, K] or None)``: the forward of ``support_logprobs``."""
    z = logits.gather(1, ids).to(temp.dtype) / temp
    lse, probs = _masked_logsumexp(z, valid, softmax)
    out = logits.gather(1, targets[:, None]).to(temp.dtype).squeeze(1) / temp.squeeze(1) - lse
    return out, probs


def support_grad(shape, dtype, ids, valid, probs, targets, coef, holds_target=None, reduce=None) -> torch.Tensor:
    """``[T, V]`` in ``dtype``: the gradient ``(onehot(a_t) - softmax_S) * coef`` of a support log-prob, each entry
    formed in the accumulation dtype and rounded once. ``ids``/``valid`` ``[T, K]`` (padding carries probability 0),
    ``probs`` the softmax over the support, ``targets`` ``[T]`` columns of the logits, ``coef`` ``[T, 1]``;
    ``holds_target`` ``[T]`` (vocab-parallel) False where this shard does not hold the row's target, and
    ``reduce(x)`` sums a ``[T, 1]`` over the shards.

    The target's entry ``(1 - p_a) coef`` is formed whole, as the sum of the other ids' probabilities times coef:
    as two pieces each rounded to bf16 and then added, a confident token's (p_a > 0.99) cancelled to 0 and the row's
    gradient no longer summed to zero; and ``1 - p_a`` from a rounded p_a keeps only its rounding error where p_a is
    within a few float32 ulps of 1."""
    hit = (ids == targets[:, None]) & valid
    if holds_target is not None:
        hit &= holds_target[:, None]
    others = probs.masked_fill(hit, 0.0).sum(-1, keepdim=True)  # 1 - p_a without p_a's rounding
    if reduce is not None:
        others = reduce(others)
    entries = torch.where(hit, others, -probs) * coef
    grad = torch.zeros(shape, dtype=dtype, device=coef.device)
    grad.scatter_add_(1, ids, entries.to(dtype))  # a support's ids are distinct; padding adds exact zeros
    outside = ~hit.any(-1)  # a target outside its support (never in a validated sample): its entry is coef alone
    if holds_target is not None:
        outside &= holds_target
    if bool(outside.any()):
        rows = outside.nonzero().squeeze(1)
        grad[rows, targets[rows]] += coef[rows, 0].to(dtype)
    return grad


class _SupportLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, ids, valid, temp):
        out, probs = _support_logprobs(logits, targets, ids, valid, temp)
        ctx.save_for_backward(targets, ids, valid, probs, temp)
        ctx.logits_meta = (logits.shape, logits.dtype)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        targets, ids, valid, probs, temp = ctx.saved_tensors
        shape, dtype = ctx.logits_meta
        coef = grad_out.to(temp.dtype)[:, None] / temp
        return support_grad(shape, dtype, ids, valid, probs, targets, coef), None, None, None, None


def support_logprobs(logits: torch.Tensor, targets: torch.Tensor, support, temperature=1.0) -> torch.Tensor:
    """``log pi(a_t | s_t, S_t) = z(a_t)/T - logsumexp_{j in S_t} z(j)/T`` for every row.

    ``logits`` ``[T, V]`` (any float dtype; accumulation in fp32), ``targets`` ``[T]``,
    ``support`` a ``SupportTable`` of T rows or padded ``(ids[T, K], valid[T, K])``,
    ``temperature`` a scalar or ``[T]``. Returns ``[T]`` in fp32 (fp64 for fp64 input). Extra memory is O(T*K);
    the gradient is ``(onehot(a_t) - softmax_S)/T`` on S_t and zero elsewhere.
    """
    if logits.ndim != 2:
        raise SupportError(f"logits: expected [T, V], got shape {tuple(logits.shape)}")
    rows = logits.shape[0]
    ids, valid = _padded(support, logits.device)
    if ids.shape[0] != rows or targets.shape != (rows,):
        raise SupportError(
            f"support_logprobs: {rows} logit rows, {ids.shape[0]} support rows, targets {tuple(targets.shape)}"
        )
    if rows == 0:
        return logits.new_zeros(0, dtype=_acc(logits.dtype)) + logits.sum() * 0
    temp = _temperature_column(temperature, rows, logits.device, _acc(logits.dtype))
    targets = targets.to(logits.device, torch.long)
    if not (torch.is_grad_enabled() and logits.requires_grad):  # the engine's log mu: no graph, no softmax kept
        return _support_logprobs(logits, targets, ids, valid, temp, softmax=False)[0]
    return _SupportLogProbs.apply(logits, targets, ids, valid, temp)


def support_row_logprobs(logits_row: torch.Tensor, ids: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``log mu`` of every id of one support row (``[n]`` fp32), in O(n): the operations of
    ``support_logprobs`` for that row (the same ``z/T``, the same log-sum-exp), so the selected
    id's value is its bits."""
    ids = ids.to(logits_row.device, torch.long)[None]
    temp = _temperature_column(temperature, 1, logits_row.device, _acc(logits_row.dtype))
    z = logits_row[None].gather(1, ids).to(temp.dtype) / temp
    lse, _ = _masked_logsumexp(z, torch.ones_like(ids, dtype=torch.bool))
    return (z - lse[:, None])[0]


def support_rows_logprobs(z: torch.Tensor, valid: torch.Tensor, temperature=1.0) -> torch.Tensor:
    """``log pi(v | S_t)`` for every id v of every support row: ``z`` ``[T, K]`` the (raw or penalised)
    logits at the padded support ids, ``valid`` ``[T, K]``; ``[T, K]`` fp32, 0 at padding. Plain
    autograd (score centering differentiates every id's log-prob, docs/math.md). The same ``z/T`` and
    log-sum-exp as ``support_logprobs``, so the selected id's column is its value."""
    rows = z.shape[0]
    temp = _temperature_column(temperature, rows, z.device, _acc(z.dtype))
    scaled = z.to(temp.dtype) / temp
    lse, _ = _masked_logsumexp(scaled, valid)
    return (scaled - lse[:, None]).masked_fill(~valid, 0.0)


HEAD_ROWS_BUDGET = 1 << 24  # elements of the gathered head rows [n, K, H] at a time


def head_rows_at(h: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[N, K]`` logits ``h . W[ids]`` of a linear head at the padded support ids, plain autograd, never
    ``[N, V]``: rows in chunks so the gathered ``[n, K, H]`` head rows stay within ``HEAD_ROWS_BUDGET``."""
    rows, width = ids.shape
    step = max(1, HEAD_ROWS_BUDGET // max(1, width * h.shape[-1]))
    parts = [
        torch.bmm(weight[ids[i : i + step]].to(h.dtype), h[i : i + step, :, None]).squeeze(-1)
        for i in range(0, rows, step)
    ]
    return torch.cat(parts) if parts else h.new_zeros(0, width)


def penalised_support_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, support, temperature, transform
) -> torch.Tensor:
    """``support_logprobs`` on transformed logits: ``log pi(a_t | S_t) = z'(a_t)/T - logsumexp_{S_t} z'/T``
    with ``z' = transform(z gathered at the support ids [T, K], ids)``, plain autograd (the
    gradient flows through the transform to ``z``). The penalties and logit bias are such a
    transform (``penalties.penalise``); it never sees more than the support's ids, so memory
    stays O(T*K). The engine applies the same transform to whole rows before it samples and
    calls ``support_logprobs`` on them: the values at the support ids, and so the result, are
    the same bits.
    """
    rows = logits.shape[0]
    ids, valid = _padded(support, logits.device)
    temp = _temperature_column(temperature, rows, logits.device, _acc(logits.dtype))
    column = target_positions(ids, valid, targets.to(logits.device, torch.long))
    z = transform(logits.gather(1, ids).to(temp.dtype), ids) / temp
    lse, _ = _masked_logsumexp(z, valid)
    return z.gather(1, column[:, None]).squeeze(1) - lse


# ---- full vocabulary -----------------------------------------------------------------


def chunk_rows_for(logits: torch.Tensor, chunk_rows: int | None = None) -> int:
    """Rows of ``logits`` per chunk of the full-vocabulary passes: ``chunk_rows`` where given (at least 1),
    else ``CPU_CHUNK_BYTES`` of accumulation-dtype temporaries on a CPU (at least 2 rows), ``DEFAULT_CHUNK_ROWS``
    elsewhere."""
    if chunk_rows is not None:
        if int(chunk_rows) < 1:
            raise SupportError(f"chunk_rows: must be at least 1, got {chunk_rows}")
        return int(chunk_rows)
    if logits.device.type != "cpu":
        return DEFAULT_CHUNK_ROWS
    row_bytes = max(logits.shape[-1], 1) * torch.empty((), dtype=_acc(logits.dtype)).element_size()
    return min(DEFAULT_CHUNK_ROWS, max(2, CPU_CHUNK_BYTES // row_bytes))


def _chunks(rows: int, chunk_rows: int):
    """Row slices of at most ``chunk_rows`` rows (one more for the last) and never a lone last row where there are
    more: ATen reduces a one-row tensor along another path, so a row's bits would depend on where the chunks cut."""
    starts = list(range(0, rows, chunk_rows))
    if len(starts) > 1 and rows - starts[-1] == 1:
        starts.pop()
    for start, stop in zip(starts, starts[1:] + [rows]):
        yield slice(start, stop)


def _chunk_logprobs(logits, targets, temp, sl: slice):
    """Rows ``sl``'s ``(z/T, logsumexp(z/T), log softmax(z/T)[a_t])``: the one computation of the full log-probs."""
    y = logits[sl].to(temp.dtype) / temp[sl]
    lse = torch.logsumexp(y, dim=-1)
    return y, lse, y.gather(1, targets[sl, None]).squeeze(1) - lse


class _FullLogProbs(torch.autograd.Function):
    """Full-vocabulary log-prob of the targets alone, chunked over rows: ``_FullLogProbsEntropy``'s log-probs, the
    same operations and bits, without the entropy's passes over each chunk (its exponentials and weighted sum)."""

    @staticmethod
    def forward(ctx, logits, targets, temp, chunk_rows):
        rows = logits.shape[0]
        logp = torch.empty(rows, dtype=temp.dtype, device=logits.device)
        lse = torch.empty_like(logp)
        for sl in _chunks(rows, chunk_rows):
            _, lse[sl], logp[sl] = _chunk_logprobs(logits, targets, temp, sl)
        ctx.save_for_backward(logits, targets, temp, lse)
        ctx.chunk_rows = chunk_rows
        return logp

    @staticmethod
    def backward(ctx, grad_logp):
        logits, targets, temp, lse = ctx.saved_tensors
        grad = full_vocab_grad(logits, targets, None, temp, lse, None, grad_logp, None, ctx.chunk_rows)
        return grad, None, None, None


class _FullLogProbsEntropy(torch.autograd.Function):
    """Full-vocabulary log-prob of the targets and entropy, chunked over rows.

    Saves only the logits and per-row scalars; the softmax is recomputed chunk by chunk
    in backward, so no second ``[T, V]`` copy is kept between forward and backward.
    """

    @staticmethod
    def forward(ctx, logits, targets, temp, chunk_rows):
        rows = logits.shape[0]
        logp = torch.empty(rows, dtype=temp.dtype, device=logits.device)
        ent = torch.empty_like(logp)
        lse = torch.empty_like(logp)
        for sl in _chunks(rows, chunk_rows):
            y, lse[sl], logp[sl] = _chunk_logprobs(logits, targets, temp, sl)
            p = torch.exp(y - lse[sl, None])
            ent[sl] = lse[sl] - (p * y).sum(-1)
        ctx.save_for_backward(logits, targets, temp, lse, ent)
        ctx.chunk_rows = chunk_rows
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        logits, targets, temp, lse, ent = ctx.saved_tensors
        grad = full_vocab_grad(logits, targets, None, temp, lse, ent, grad_logp, grad_ent, ctx.chunk_rows)
        return grad, None, None, None


def full_vocab_grad(
    logits, targets, target_weight, temp, lse, ent, grad_logp, grad_ent, chunk_rows: int
) -> torch.Tensor:
    """Gradient of ``(log p[a_t], entropy)`` w.r.t. the logits, recomputing softmax chunk by chunk.

    ``lse`` and ``ent`` are the (global) normalisers; ``target_weight`` (0/1 per row, or
    None for all ones) says whether this logit shard holds the target, for vocab-parallel.
    """
    grad = torch.empty_like(logits)
    for sl in _chunks(logits.shape[0], chunk_rows):
        y = logits[sl].to(temp.dtype) / temp[sl]
        p = torch.exp(y - lse[sl, None])
        g = torch.zeros_like(p)
        if grad_logp is not None:
            gl = grad_logp[sl, None].to(temp.dtype)
            g -= p * gl
            g.scatter_add_(1, targets[sl, None], gl if target_weight is None else gl * target_weight[sl, None])
        if grad_ent is not None:
            # dH/dy_j = -p_j (log p_j + H)
            g -= grad_ent[sl, None].to(temp.dtype) * p * ((y - lse[sl, None]) + ent[sl, None])
        grad[sl] = (g / temp[sl]).to(logits.dtype)
    return grad


def _full_inputs(logits, targets, temperature, chunk_rows: int | None):
    if logits.ndim != 2 or targets.shape != (logits.shape[0],):
        raise SupportError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not match")
    temp = _temperature_column(temperature, logits.shape[0], logits.device, _acc(logits.dtype))
    return targets.to(logits.device, torch.long), temp, chunk_rows_for(logits, chunk_rows)


def full_logprobs_and_entropy(
    logits: torch.Tensor, targets: torch.Tensor, temperature=1.0, chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log softmax(z/T)[a_t], entropy of softmax(z/T))`` over the full vocabulary, fp32 ``[T]``; ``chunk_rows``
    rows at a time (default ``chunk_rows_for(logits)``)."""
    targets, temp, rows = _full_inputs(logits, targets, temperature, chunk_rows)
    return _FullLogProbsEntropy.apply(logits, targets, temp, rows)


def full_logprobs(logits, targets, temperature=1.0, chunk_rows: int | None = None) -> torch.Tensor:
    """Full-vocabulary ``log softmax(z/T)[a_t]`` (reference, KL, evaluation scores): the bits of
    ``full_logprobs_and_entropy``'s first output, without computing the entropy."""
    targets, temp, rows = _full_inputs(logits, targets, temperature, chunk_rows)
    return _FullLogProbs.apply(logits, targets, temp, rows)


def top_full_logprobs(logits: torch.Tensor, k: int, temperature=1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-probs, ids)`` ``[T, k]`` of the ``k`` most likely ids of the full ``softmax(z/T)``, most likely
    first (ties in id order): the top log-probs of an unfiltered request."""
    if logits.ndim != 2 or not 1 <= k <= logits.shape[1]:
        raise SupportError(f"top_full_logprobs: k={k} for logits of shape {tuple(logits.shape)}")
    ids = torch.sort(logits, dim=-1, descending=True, stable=True).indices[:, :k]  # z/T keeps z's order for T > 0
    rows = logits.shape[0]
    temps = _temperature_column(temperature, rows, logits.device, _acc(logits.dtype)).expand(rows, k).reshape(-1)
    # full_logprobs itself, so the sampled token's entry has the bits of its own log-prob
    values = full_logprobs(logits.repeat_interleave(k, dim=0), ids.reshape(-1), temps)
    return values.reshape(rows, k), ids


def entropy(logits, temperature=1.0, chunk_rows: int | None = None) -> torch.Tensor:
    """Full-vocabulary entropy of ``softmax(z/T)`` per row."""
    targets = torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device)
    return full_logprobs_and_entropy(logits, targets, temperature, chunk_rows)[1]


# ---- sparse LM head ------------------------------------------------------------------


def target_positions(ids, valid, targets) -> torch.Tensor:
    """``[T]``: where each row's target sits among its padded support ids; a target outside its support is refused."""
    hit = (ids == targets[:, None]) & valid
    if not bool(hit.any(-1).all()):
        row = int((~hit.any(-1)).nonzero()[0])
        raise SupportError(f"row {row}: target {int(targets[row])} is not in its support")
    return hit.to(torch.uint8).argmax(-1)


def _size_buckets(valid: torch.Tensor, chunk_size: int):
    """Rows grouped by support size rounded up to a power of two, in chunks of about
    ``chunk_size`` entries: ``(rows, width)`` pairs. Padding waste stays under 2x even
    when sizes are heavy-tailed (most supports tiny, a few wide)."""
    sizes = valid.sum(-1)
    widths = torch.where(sizes <= 1, 1, 2 ** torch.ceil(torch.log2(sizes.clamp_min(1).double())).long())
    widths = widths.clamp_max(valid.shape[1])
    for width in torch.unique(widths).tolist():
        rows = (widths == width).nonzero().squeeze(1)
        step = max(1, chunk_size // width)
        for start in range(0, len(rows), step):
            yield rows[start : start + step], width


class _SparseHeadSupportLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, ids, valid, tpos, temp, chunk_size):
        z = torch.zeros(ids.shape, dtype=temp.dtype, device=hidden.device)
        for rows, width in _size_buckets(valid, chunk_size):
            w = weight[ids[rows, :width]].to(temp.dtype)  # [c, width, H]
            z[rows, :width] = torch.einsum("ch,ckh->ck", hidden[rows].to(temp.dtype), w).to(
                z.dtype
            )  # bf16 under autocast
        z = z / temp
        lse, probs = _masked_logsumexp(z, valid)
        out = z.gather(1, tpos[:, None]).squeeze(1) - lse
        ctx.save_for_backward(hidden, weight, ids, valid, tpos, probs, temp)
        ctx.chunk_size = chunk_size
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, ids, valid, tpos, probs, temp = ctx.saved_tensors
        coef = grad_out[:, None].to(temp.dtype) / temp
        dz = -probs * coef
        dz.scatter_add_(1, tpos[:, None], coef)
        grad_h = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        # the head rows' gradients summed in the accumulation dtype, rounded once at the end
        grad_w = torch.zeros(weight.shape, dtype=temp.dtype, device=weight.device) if ctx.needs_input_grad[1] else None
        for rows, width in _size_buckets(valid, ctx.chunk_size):
            g = dz[rows, :width]  # zero on padding entries
            sel = ids[rows, :width]
            if grad_h is not None:
                w = weight[sel].to(temp.dtype)  # recomputed, not stored
                grad_h[rows] = torch.einsum("ck,ckh->ch", g, w).to(hidden.dtype)
            if grad_w is not None:
                outer = g[:, :, None] * hidden[rows].to(temp.dtype)[:, None, :]
                grad_w.index_add_(0, sel.reshape(-1), outer.reshape(-1, hidden.shape[1]))
        grad_w = grad_w.to(weight.dtype) if grad_w is not None else None
        return grad_h, grad_w, None, None, None, None, None


def sparse_head_support_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    support,
    temperature=1.0,
    chunk_size: int = 16384,
) -> torch.Tensor:
    """``support_logprobs(hidden @ weight.T, ...)`` without forming ``[T, V]`` logits.

    ``hidden`` ``[T, H]``, ``weight`` ``[V, H]`` (the LM head, no bias). Only the rows of
    the weight named by the support are read, about ``chunk_size`` support entries at a
    time, rows bucketed by support size; backward recomputes ``weight[S]`` instead of
    storing it. Every target must lie in its support.
    """
    if hidden.ndim != 2 or weight.ndim != 2 or hidden.shape[1] != weight.shape[1]:
        raise SupportError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match")
    rows = hidden.shape[0]
    ids, valid = _padded(support, hidden.device)
    if ids.shape[0] != rows or targets.shape != (rows,):
        raise SupportError(
            f"sparse head: {rows} hidden rows, {ids.shape[0]} support rows, targets {tuple(targets.shape)}"
        )
    temp = _temperature_column(temperature, rows, hidden.device, _acc(torch.promote_types(hidden.dtype, weight.dtype)))
    tpos = target_positions(ids, valid, targets.to(hidden.device, torch.long))
    return _SparseHeadSupportLogProbs.apply(hidden, weight, ids, valid, tpos, temp, int(chunk_size))
