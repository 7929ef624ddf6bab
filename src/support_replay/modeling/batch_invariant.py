"""A batch-invariant forward for Hugging Face decoder models (true-on-policy mode).

The logits of a sequence must not depend on what else is in the batch, on padding, or on
how the sequence was split between prefill and decode steps, so that the engine (KV cache,
left-padded batches) and the trainer (one right-padded forward) compute the same bits.
Measured on this project's CPU (docs/true-on-policy.md): a row of ``F.linear`` (MKL) is the
same bits whatever the other rows hold and wherever it sits, once the row count is a multiple
of 16 (1, 2 or ragged row counts take other kernels); a row of oneDNN's fp32 product, from 2
rows on (modeling/linear_kernels.py); row reductions (RMSNorm) and
elementwise ops (RoPE, SiLU, residuals) are per row already. Attention is the one place
where shapes differ between the two sides; here it runs in tiles of one fixed shape, keys in
blocks counted from the sequence start, block results added in position order, so a query
row gets the same bits in a decode step over a left-padded cache as in a full forward.

``make_batch_invariant(model)`` switches a loaded model to this forward in place.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .linear_kernels import INVARIANT_ROWS, linear_function, padded, use_linear

ATTENTION = "support_replay_batch_invariant"
ROW_BLOCK = 16  # rows of every attention tile (and MKL's linear products: linear_kernels.INVARIANT_ROWS)
KEY_BLOCK = 64  # keys per attention block, counted from the sequence start


def _aligned_keys(key, value, allowed):
    """Keys, values and the mask shifted per row so that index j holds sequence position j
    (the engine's cache is left-padded, the trainer's batch right-padded), padded to whole
    key blocks; a row's start is its first key any query may see."""
    batch, heads, k_len, dim = key.shape
    seen = allowed.any(1)  # [B, L]
    start = torch.where(seen.any(1), seen.int().argmax(1), 0)
    width = -(-int((k_len - start).max()) // KEY_BLOCK) * KEY_BLOCK
    if bool((start == 0).all()):  # already aligned (the trainer's batch; the engine's slot cache, whole blocks wide): no gather
        extra = width - k_len
        if extra > 0:
            key, value, allowed = F.pad(key, (0, 0, 0, extra)), F.pad(value, (0, 0, 0, extra)), F.pad(allowed, (0, extra))
        return key[:, :, :width], value[:, :, :width], allowed[:, :, :width]
    index = start[:, None] + torch.arange(width, device=key.device)[None]
    inside = index < k_len
    index = index.clamp_max(k_len - 1)
    rows = index[:, None, :, None].expand(batch, heads, width, dim)
    gathered = allowed.gather(2, index[:, None, :].expand(-1, allowed.shape[1], -1)) & inside[:, None, :]
    return key.gather(2, rows), value.gather(2, rows), gathered


def batch_invariant_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Attention in fixed-shape tiles with a fixed reduction order; returns ``[B, q, H, d]``.

    Keys are aligned to the sequence start and cut into blocks of ``KEY_BLOCK`` positions;
    queries into tiles of ``ROW_BLOCK`` rows. Scores are ``[16, d] x [d, width]`` per tile (a
    score's bits depend on neither the other rows nor the number of key columns); the weighted
    sum runs per block, ``[16, 64] x [64, d]``, so its reduction has one fixed shape whatever
    the batch, the padding or the prefill/decode split (a batched product of one fixed shape
    gives each row the same bits whatever the batch count and the row's place: measured,
    tests/test_batch_invariant.py). A key sits at the same place of the same block on both
    sides; masked keys weigh exactly 0; the softmax runs over the position-aligned row, and the
    blocks' partial outputs are added in position order.
    Autograd gives the backward.
    """
    batch, heads, q_len, dim = query.shape
    groups = key.shape[1]
    repeat = heads // groups  # query heads per key/value head (grouped-query attention)
    scale = dim**-0.5 if scaling is None else scaling
    k_len = key.shape[2]
    if attention_mask is None:  # plain causal, no padding
        allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device).tril(k_len - q_len)[None].expand(batch, -1, -1)
    else:
        mask = attention_mask[:, 0]
        allowed = mask if mask.dtype == torch.bool else mask == 0
    key, value, allowed = _aligned_keys(key, value, allowed)
    width = key.shape[2]
    blocks = width // KEY_BLOCK
    if q_len == 1 and repeat <= ROW_BLOCK:
        return _one_query_per_sequence(query, key, value, allowed, scale), None
    # the rows of a key/value head: its query heads x positions, tiled 16 at a time (a decode step's
    # heads share a tile); no key is copied per query head
    rows = repeat * q_len
    row_allowed = allowed[:, None].expand(batch, repeat, q_len, width).reshape(batch, 1, rows, width)
    q_extra = -rows % ROW_BLOCK
    tiles = (rows + q_extra) // ROW_BLOCK
    q_tiles = F.pad(query.reshape(batch, groups, rows, dim), (0, 0, 0, q_extra)).reshape(batch, groups, tiles, ROW_BLOCK, dim)
    # one [16, d] x [d, width] product per tile: a score's bits do not depend on how many key
    # columns share the product (measured: equal to 64-key blocks, tests/test_batch_invariant.py)
    scores = torch.matmul(q_tiles, key.transpose(-1, -2)[:, :, None])  # [B, G, tiles, 16, width]
    scores = scores.reshape(batch, groups, tiles * ROW_BLOCK, width)[:, :, :rows] * scale
    live = row_allowed.any(-1, keepdim=True)  # a padding query sees nothing: zeros, never NaN
    scores = scores.masked_fill(~row_allowed, float("-inf")).masked_fill(~live, 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(~row_allowed, 0.0)
    p_tiles = F.pad(probs, (0, 0, 0, q_extra)).reshape(batch, groups, tiles, ROW_BLOCK, blocks, KEY_BLOCK).transpose(3, 4)
    parts = torch.matmul(p_tiles, value.reshape(batch, groups, 1, blocks, KEY_BLOCK, dim))  # [B, G, tiles, blocks, 16, d]
    out = parts[:, :, :, 0]
    for b in range(1, blocks):  # position order, the same on both sides; empty blocks add exact zeros
        out = out + parts[:, :, :, b]
    out = out.reshape(batch, groups, tiles * ROW_BLOCK, dim)[:, :, :rows]
    return out.reshape(batch, heads, q_len, dim).transpose(1, 2), None


def _one_query_per_sequence(query, key, value, allowed, scale):
    """``batch_invariant_attention`` for a decode step (one query position per sequence): the same
    products, masks and additions in the same order, so the same bits (tested against the
    general path), without broadcasting the keys over tiles: one tile per key/value head (its
    query heads, padded to ``ROW_BLOCK`` rows), products over views of the cache."""
    batch, heads, _, dim = query.shape
    groups, width = key.shape[1], key.shape[2]
    repeat = heads // groups
    pairs = batch * groups
    q = F.pad(query.reshape(pairs, repeat, dim), (0, 0, 0, ROW_BLOCK - repeat))  # [B*G, 16, d]
    k = key.reshape(pairs, width, dim)  # a view of the engine's slot cache where its strides allow
    v = value.reshape(pairs, width, dim)
    seen = allowed.reshape(batch, 1, 1, width).expand(batch, groups, repeat, width).reshape(pairs, repeat, width)
    scores = torch.bmm(q, k.transpose(1, 2))[:, :repeat] * scale
    live = seen.any(-1, keepdim=True)
    scores = scores.masked_fill(~seen, float("-inf")).masked_fill(~live, 0.0)
    probs = F.pad(torch.softmax(scores, dim=-1).masked_fill(~seen, 0.0), (0, 0, 0, ROW_BLOCK - repeat))
    out = torch.bmm(probs[:, :, :KEY_BLOCK], v[:, :KEY_BLOCK])
    for start in range(KEY_BLOCK, width, KEY_BLOCK):  # position order, as the general path
        out = out + torch.bmm(probs[:, :, start : start + KEY_BLOCK], v[:, start : start + KEY_BLOCK])
    return out[:, :repeat].reshape(batch, heads, 1, dim).transpose(1, 2)


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def full_mask(*args, **kwargs):
        kwargs["allow_is_causal_skip"] = False  # always a boolean mask: padding must be seen
        return sdpa_mask(*args, **kwargs)

    AttentionInterface.register(ATTENTION, batch_invariant_attention)
    AttentionMaskInterface.register(ATTENTION, full_mask)


def batch_invariant_linear(kernel: str = "torch"):
    """The linear product of this forward: ``kernel`` (a resolved name, modeling/linear_kernels.py)
    over rows padded to the count from which its rows keep their bits (16 for MKL, 2 for oneDNN)."""
    return padded(linear_function(kernel), INVARIANT_ROWS[kernel])


def make_batch_invariant(model: nn.Module, kernel: str = "torch") -> nn.Module:
    """Batch-invariant linears (on ``kernel``) and attention for ``model`` (a Hugging Face causal LM), in place.
    The engine and the trainer of one run must pass the same kernel."""
    _register()
    use_linear(model, batch_invariant_linear(kernel))
    model.set_attn_implementation(ATTENTION)
    return model
