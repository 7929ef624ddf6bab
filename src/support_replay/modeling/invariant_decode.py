"""The batch-invariant attention of a decode step (one query position per sequence).

The same products, masks and additions as the general path (batch_invariant.py) in the same
order, so the same bits (tested against it and against the trainer's forward), with three
savings that keep those bits, each measured here once per shape and thread count before use
(a probe that fails keeps the general path's shape):

- no keys broadcast over tiles: one tile per key/value head, products over views of the cache;
- the tile holds the head's query heads padded to the fewest rows whose products give every
  row a full tile's bits (``tile_rows``: 4 for SmolLM2's 3 heads on MKL, not 16);
- the scores and the softmax cover the seen columns rounded up to 16 (``trimmed_width``), not
  whole key blocks: a score's bits do not depend on the columns beside it, and a softmax row's
  do not depend on trailing masked columns from 16 on; the weighted sum still runs over whole
  blocks (its reduction length is part of its bits).

A step's layers share one mask, so what is derived from it is derived once per step.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .attention_tiles import KEY_BLOCK, ROW_BLOCK, KeyLayout

PROBE_WIDTHS = (64, 128, 192, 256, 512, 1024, 2048)  # key counts the probes check
SOFTMAX_ROUND = 16  # trimmed softmax rows are whole multiples of this many columns


@functools.cache
def tile_rows(repeat: int, dim: int, dtype: torch.dtype, threads: int) -> int:
    """Rows of a decode step's attention tile: the fewest, a multiple of 4 and at least ``repeat``,
    whose products give every row the bits it has in a ``ROW_BLOCK``-row tile, else ``ROW_BLOCK``.
    Checked on both products (scores over a transposed cache view, the weighted sum over one key
    block), 1 and 3 tiles per call, widths up to 2048 keys. On this project's CPU (MKL) 4, 8 and
    12 rows give the 16-row bits and 1-3 rows do not (docs/true-on-policy.md)."""
    gen = torch.Generator().manual_seed(0)
    for rows in range(max(4, -(-repeat // 4) * 4), ROW_BLOCK, 4):
        same = True
        for pairs in (1, 3):
            q = torch.randn(pairs, ROW_BLOCK, dim, generator=gen).to(dtype)
            for width in PROBE_WIDTHS:
                keys = torch.randn(pairs, width, dim, generator=gen).to(dtype).transpose(1, 2)
                same &= torch.equal(torch.bmm(q[:, :rows].contiguous(), keys), torch.bmm(q, keys)[:, :rows])
            probs = torch.rand(pairs, ROW_BLOCK, KEY_BLOCK, generator=gen).to(dtype)
            values = torch.randn(pairs, KEY_BLOCK, dim, generator=gen).to(dtype)
            same &= torch.equal(torch.bmm(probs[:, :rows].contiguous(), values), torch.bmm(probs, values)[:, :rows])
        if same:
            return rows
    return ROW_BLOCK


@functools.cache
def softmax_trims(dtype: torch.dtype, threads: int) -> bool:
    """Whether a softmax row over ``n`` seen columns rounded up to ``SOFTMAX_ROUND`` (masked tail)
    has the bits of the same row over whole key blocks and one more (checked for every ``n`` from
    1 to 320 and for 3 and 96 rows). A row of fewer than 16 columns takes another path through
    PyTorch's CPU softmax (measured), so a trimmed row has at least 16."""
    gen = torch.Generator().manual_seed(1)
    for rows in (3, 96):
        for n in range(1, 321):
            trimmed = max(SOFTMAX_ROUND, -(-n // SOFTMAX_ROUND) * SOFTMAX_ROUND)
            full = -(-n // KEY_BLOCK) * KEY_BLOCK + KEY_BLOCK
            scores = torch.full((rows, full), float("-inf"), dtype=dtype)
            scores[:, :n] = (torch.randn(rows, n, generator=gen) * 4).to(dtype)
            if not torch.equal(torch.softmax(scores[:, :trimmed], -1), torch.softmax(scores, -1)[:, :trimmed]):
                return False
    return True


def trimmed_width(allowed: torch.Tensor, dtype: torch.dtype) -> int:
    """Columns a decode step's scores and softmax cover: up to the last seen key of any row,
    rounded up to ``SOFTMAX_ROUND`` (the whole aligned width when the softmax probe failed)."""
    width = allowed.shape[-1]
    if not softmax_trims(dtype, torch.get_num_threads()):
        return width
    seen = allowed.reshape(-1, width).any(0).nonzero()
    last = int(seen[-1]) + 1 if len(seen) else 0
    return min(width, max(SOFTMAX_ROUND, -(-last // SOFTMAX_ROUND) * SOFTMAX_ROUND))


def _step_masks(layout: KeyLayout, groups: int, repeat: int, dtype: torch.dtype):
    """Derived once per step: the trimmed width, ``[B*G, repeat, columns]`` True where a key is
    hidden, and whether every row sees a key (then the general path's padding-query fills are no-ops)."""
    key = ("decode", groups, repeat, dtype)
    masks = layout.derived.get(key)
    if masks is None:
        allowed = layout.allowed  # [B, 1, width]
        batch = allowed.shape[0]
        columns = trimmed_width(allowed, dtype)
        seen = (
            allowed[:, :, :columns]
            .reshape(batch, 1, 1, columns)
            .expand(batch, groups, repeat, columns)
            .reshape(batch * groups, repeat, columns)
        )
        masks = columns, ~seen, bool(seen.any(-1).all())
        layout.derived[key] = masks
    return masks


def one_query_per_sequence(query, key, value, layout: KeyLayout, scale: float) -> torch.Tensor:
    """``[B, 1, H, d]`` attention output of a decode step; ``key`` and ``value`` are in ``layout``
    (``[B, G, width, d]``, the engine's gathered blocks: a rectangle's inner strides)."""
    batch, heads, _, dim = query.shape
    groups, width = key.shape[1], key.shape[2]
    repeat = heads // groups
    pairs = batch * groups
    tile = tile_rows(repeat, dim, query.dtype, torch.get_num_threads())
    columns, hidden, all_live = _step_masks(layout, groups, repeat, query.dtype)
    q = F.pad(query.reshape(pairs, repeat, dim), (0, 0, 0, tile - repeat))  # [B*G, tile, d]
    k = key.reshape(pairs, width, dim)
    v = value.reshape(pairs, width, dim)
    scores = torch.bmm(q, k[:, :columns].transpose(1, 2))[:, :repeat] * scale
    scores = scores.masked_fill(hidden, float("-inf"))
    if not all_live:  # a row that sees nothing: zeros, as the general path's padding queries
        live = ~hidden.all(-1, keepdim=True)
        scores = scores.masked_fill(~live, 0.0)
    probs = torch.softmax(scores, dim=-1)
    if not all_live:  # masked keys of live rows are exact zeros already
        probs = probs.masked_fill(hidden, 0.0)
    probs = F.pad(probs, (0, width - columns, 0, tile - repeat))
    out = torch.bmm(probs[:, :, :KEY_BLOCK], v[:, :KEY_BLOCK])
    for start in range(KEY_BLOCK, width, KEY_BLOCK):  # position order, as the general path
        out = out + torch.bmm(probs[:, :, start : start + KEY_BLOCK], v[:, start : start + KEY_BLOCK])
    return out[:, :repeat].reshape(batch, heads, 1, dim).transpose(1, 2)
