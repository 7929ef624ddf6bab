"""Support log-probs when the vocabulary (TP) or the sequence (CP) is split over ranks.

Tensor parallelism (docs/math.md, "vocab-parallel"): each rank holds logits for its vocab
shard ``[vocab_start, vocab_start + V_local)``. The support normaliser is assembled with
three small all-reduces, as vocab-parallel cross-entropy does: MAX of the local support
maxima, SUM of the local exp-sums, SUM of the target logit (held by exactly one rank).
No rank ever sees full-vocabulary logits. The collectives run in forward only; each
rank's backward produces the gradient of its own shard from the global normaliser, so a
loss replicated on every rank gets exactly the single-device gradient (an autograd
all-reduce would sum the replicas' gradients, world-size times too large).

Context parallelism: which sequence positions a CP rank holds (contiguous, or zigzag with
2*cp chunks for causal load balance), which response rows those positions score, and
putting per-rank results back in order. Process groups are always passed in.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from ..errors import SupportError
from .logprobs import _acc, _chunks, _padded, _temperature_column, chunk_rows_for, full_vocab_grad, support_grad


def _shard_index(ids: torch.Tensor, vocab_start: int, vocab_local: int):
    inside = (ids >= vocab_start) & (ids < vocab_start + vocab_local)
    return (ids - vocab_start).clamp(0, vocab_local - 1), inside


class _VocabParallelSupportLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, targets, ids, valid, temp, vocab_start, group):
        vocab_local = local_logits.shape[1]
        local_ids, inside = _shard_index(ids, vocab_start, vocab_local)
        inside &= valid
        z = local_logits.gather(1, local_ids).to(temp.dtype) / temp
        z = z.masked_fill(~inside, float("-inf"))
        m = z.max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        e = torch.exp(z - m[:, None])
        s = e.cumsum(dim=-1)[:, -1].contiguous()
        dist.all_reduce(s, op=dist.ReduceOp.SUM, group=group)
        local_t, t_inside = _shard_index(targets, vocab_start, vocab_local)
        zt = local_logits.gather(1, local_t[:, None]).squeeze(1).to(temp.dtype) / temp.squeeze(1)
        zt = torch.where(t_inside, zt, torch.zeros_like(zt))
        dist.all_reduce(zt, op=dist.ReduceOp.SUM, group=group)
        ctx.save_for_backward(local_ids, inside, e / s[:, None], local_t, t_inside, temp)
        ctx.logits_meta = (local_logits.shape, local_logits.dtype)
        ctx.group = group
        return zt - (m + torch.log(s))

    @staticmethod
    def backward(ctx, grad_out):
        local_ids, inside, probs, local_t, t_inside, temp = ctx.saved_tensors
        shape, dtype = ctx.logits_meta
        coef = grad_out.to(temp.dtype)[:, None] / temp
        group = ctx.group

        def reduce(x):
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
            return x

        grad = support_grad(shape, dtype, local_ids, inside, probs, local_t, coef, holds_target=t_inside, reduce=reduce)
        return grad, None, None, None, None, None, None


def vocab_parallel_support_logprobs(
    local_logits: torch.Tensor, targets: torch.Tensor, support, temperature, vocab_start: int, group=None
) -> torch.Tensor:
    """``support_logprobs`` over a vocab-sharded ``[T, V_local]``; every rank gets the full ``[T]`` result.

    ``support`` and ``targets`` hold global ids (the same on every rank). Rows whose support
    has no id in this shard are fine.
    """
    rows = local_logits.shape[0]
    ids, valid = _padded(support, local_logits.device)
    if ids.shape[0] != rows or targets.shape != (rows,):
        raise SupportError(
            f"vocab-parallel: {rows} logit rows, {ids.shape[0]} support rows, targets {tuple(targets.shape)}"
        )
    temp = _temperature_column(temperature, rows, local_logits.device, _acc(local_logits.dtype))
    targets = targets.to(local_logits.device, torch.long)
    return _VocabParallelSupportLogProbs.apply(local_logits, targets, ids, valid, temp, int(vocab_start), group)


class _VocabParallelFullLogProbsEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local_logits, targets, temp, vocab_start, group, chunk_rows):
        rows, vocab_local = local_logits.shape
        acc = temp.dtype
        m = torch.empty(rows, dtype=acc, device=local_logits.device)
        for sl in _chunks(rows, chunk_rows):
            m[sl] = (local_logits[sl].to(acc) / temp[sl]).max(dim=-1).values
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        sums = torch.zeros(3, rows, dtype=acc, device=local_logits.device)  # exp-sum, sum e*y, target y
        local_t, t_inside = _shard_index(targets, vocab_start, vocab_local)
        for sl in _chunks(rows, chunk_rows):
            y = local_logits[sl].to(acc) / temp[sl]
            e = torch.exp(y - m[sl, None])
            sums[0, sl] = e.sum(-1)
            sums[1, sl] = (e * y).sum(-1)
            sums[2, sl] = torch.where(t_inside[sl], y.gather(1, local_t[sl, None]).squeeze(1), 0.0)
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group)
        lse = m + torch.log(sums[0])
        ent = lse - sums[1] / sums[0]
        ctx.save_for_backward(local_logits, local_t, t_inside, temp, lse, ent)
        ctx.chunk_rows = chunk_rows
        return sums[2] - lse, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        local_logits, local_t, t_inside, temp, lse, ent = ctx.saved_tensors
        grad = full_vocab_grad(local_logits, local_t, t_inside, temp, lse, ent, grad_logp, grad_ent, ctx.chunk_rows)
        return grad, None, None, None, None, None


def vocab_parallel_full_logprobs_and_entropy(
    local_logits, targets, temperature, vocab_start: int, group=None, chunk_rows: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-vocabulary log-prob of the targets and entropy from vocab-sharded logits."""
    rows = local_logits.shape[0]
    if targets.shape != (rows,):
        raise SupportError(f"vocab-parallel: {rows} logit rows, targets {tuple(targets.shape)}")
    temp = _temperature_column(temperature, rows, local_logits.device, _acc(local_logits.dtype))
    targets = targets.to(local_logits.device, torch.long)
    return _VocabParallelFullLogProbsEntropy.apply(
        local_logits, targets, temp, int(vocab_start), group, chunk_rows_for(local_logits, chunk_rows)
    )


def vocab_shard(vocab_size: int, rank: int, world: int) -> tuple[int, int]:
    """``(start, stop)`` of rank's contiguous vocab shard (the first shards one larger when uneven)."""
    base, extra = divmod(vocab_size, world)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


# ---- context parallelism -----------------------------------------------------------

LAYOUTS = ("contiguous", "zigzag")


def context_parallel_positions(seq_len: int, cp_rank: int, cp_size: int, layout: str = "zigzag") -> np.ndarray:
    """Sequence positions held by ``cp_rank``, in the order the rank holds them.

    ``contiguous``: cp_size consecutive chunks. ``zigzag``: 2*cp_size chunks, rank r holds
    chunks r and 2*cp_size-1-r, so every rank gets the same share of causal attention work.
    Uneven lengths give the first chunks one extra position.
    """
    if layout not in LAYOUTS:
        raise SupportError(f"layout: must be one of {LAYOUTS}, got {layout!r}")
    if not 0 <= cp_rank < cp_size:
        raise SupportError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    positions = np.arange(seq_len, dtype=np.int64)
    if layout == "contiguous":
        return np.array_split(positions, cp_size)[cp_rank]
    chunks = np.array_split(positions, 2 * cp_size)
    return np.concatenate([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])


def context_parallel_response_rows(positions: np.ndarray, prompt_len: int, response_len: int):
    """``(local_index, rows)``: which held positions score which response rows.

    The logits at position p predict the token at p + 1, so response row i (the token at
    ``prompt_len + i``) is scored by position ``prompt_len + i - 1``.
    """
    rows = np.asarray(positions, np.int64) - (prompt_len - 1)
    keep = (rows >= 0) & (rows < response_len)
    return np.flatnonzero(keep), rows[keep]


def context_parallel_restore(parts, rows_per_rank, num_rows: int) -> torch.Tensor:
    """Put per-rank results back in row order: ``out[rows_per_rank[r]] = parts[r]``."""
    first = parts[0]
    out = first.new_empty((num_rows, *first.shape[1:]))
    filled = np.zeros(num_rows, bool)
    for part, rows in zip(parts, rows_per_rank):
        rows = np.asarray(rows, np.int64)
        if len(rows) != part.shape[0]:
            raise SupportError(f"context-parallel restore: {part.shape[0]} values for {len(rows)} rows")
        out[torch.from_numpy(rows).to(out.device)] = part
        filled[rows] = True
    if not filled.all():
        raise SupportError(f"context-parallel restore: rows {np.flatnonzero(~filled)[:5].tolist()} not covered")
    return out


def context_parallel_gather(local_values: torch.Tensor, rows_per_rank, num_rows: int, group=None) -> torch.Tensor:
    """All-gather per-rank values (no gradient) and return them in row order on every rank."""
    width = max(len(r) for r in rows_per_rank)
    padded = local_values.new_zeros((width, *local_values.shape[1:]))
    padded[: local_values.shape[0]] = local_values.detach()
    gathered = [torch.empty_like(padded) for _ in rows_per_rank]
    dist.all_gather(gathered, padded, group=group)
    parts = [g[: len(r)] for g, r in zip(gathered, rows_per_rank)]
    return context_parallel_restore(parts, rows_per_rank, num_rows)
