"""A batch-invariant forward for Hugging Face decoder models (true-on-policy mode).

The logits of a sequence must not depend on what else is in the batch, on padding, or on
how the sequence was split between prefill and decode steps, so that the engine (KV cache,
left-padded batches) and the trainer (one right-padded forward) compute the same bits.
A row of a linear product keeps its bits whatever the other rows hold under a plan probed per
weight shape on this CPU (rows padded to a multiple, or fixed-shape tiles:
modeling/invariant_products.py; a CPU without one is refused); row reductions (RMSNorm) and
elementwise ops (RoPE, SiLU, residuals) are per row already. Attention is the one place
where shapes differ between the two sides; here it runs in tiles of one fixed shape, keys in
blocks counted from the sequence start, block results added in position order, so a query
row gets the same bits in a decode step over a left-padded cache as in a full forward.

``make_batch_invariant(model)`` switches a loaded model to this forward in place.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from .attention_tiles import KEY_BLOCK, ROW_BLOCK, layout_for
from .invariant_decode import one_query_per_sequence
from .invariant_products import invariant_linear, model_plans
from .linear_kernels import use_linear
from .packed_sequences import packed_layout_for

__all__ = [
    "ATTENTION",
    "KEY_BLOCK",
    "ROW_BLOCK",
    "batch_invariant_attention",
    "batch_invariant_linear",
    "make_batch_invariant",
]

ATTENTION = "support_replay_batch_invariant"


@functools.cache
def tall_products_keep_tile_bits(dim: int, dtype: torch.dtype, threads: int) -> bool:
    """Whether one ``[16 t, d] x [d, width]`` product (and ``[16 t, 64] x [64, d]``) gives every row
    the bits of its own 16-row tile's product, for 2 to 64 tiles, widths 64 to 2048 and 1 and 3
    products per call. Measured on this project's CPU (MKL): yes, at 1 and 2 threads. The
    general path then computes one product per key/value head instead of copying its keys and
    values once per tile; otherwise it keeps the tiles."""
    gen = torch.Generator().manual_seed(2)
    for tiles in (2, 3, 7, 21, 64):
        for pairs in (1, 3):
            rows = tiles * ROW_BLOCK
            q = torch.randn(pairs, rows, dim, generator=gen).to(dtype)
            for width in (64, 192, 512, 2048):
                keys = torch.randn(pairs, width, dim, generator=gen).to(dtype).transpose(1, 2)
                per_tile = torch.bmm(
                    q.reshape(pairs * tiles, ROW_BLOCK, dim), keys.repeat_interleave(tiles, 0)
                ).reshape(pairs, rows, width)
                if not torch.equal(torch.bmm(q, keys), per_tile):
                    return False
            probs = torch.rand(pairs, rows, KEY_BLOCK, generator=gen).to(dtype)
            values = torch.randn(pairs, KEY_BLOCK, dim, generator=gen).to(dtype)
            per_tile = torch.bmm(
                probs.reshape(pairs * tiles, ROW_BLOCK, KEY_BLOCK), values.repeat_interleave(tiles, 0)
            ).reshape(pairs, rows, dim)
            if not torch.equal(torch.bmm(probs, values), per_tile):
                return False
    return True


def batch_invariant_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, packed_segments=None, **kwargs
):
    """Attention in fixed-shape tiles with a fixed reduction order; returns ``[B, q, H, d]``.

    Keys are aligned to the sequence start and cut into blocks of ``KEY_BLOCK`` positions;
    queries into tiles of ``ROW_BLOCK`` rows. Scores are ``[16, d] x [d, width]`` per tile (a
    score's bits depend on neither the other rows nor the number of key columns); the weighted
    sum runs per block, ``[16, 64] x [64, d]``, so its reduction has one fixed shape whatever
    the batch, the padding or the prefill/decode split (a batched product of one fixed shape
    gives each row the same bits whatever the batch count and the row's place: measured,
    tests/modeling/test_batch_invariant.py). A key sits at the same place of the same block on both
    sides; masked keys weigh exactly 0; the softmax runs over the position-aligned row, and the
    blocks' partial outputs are added in position order.
    ``packed_segments`` (the trainer's packed rows, ``[B, L]``: -1 prompt, j response j, -2
    padding) runs one virtual row per sequence (modeling/packed_sequences.py), so a packed
    response's keys sit where they sat in the engine's cache row.
    Autograd gives the backward.
    """
    batch, heads, q_len, dim = query.shape
    scale = dim**-0.5 if scaling is None else scaling
    if packed_segments is not None:
        layout = packed_layout_for(packed_segments)
        q, k, v = layout.gather(query, key, value)
        return layout.scatter(tiled_attention(q, k, v, layout.allowed, scale)), None
    layout = layout_for(
        attention_mask, batch, q_len, key.shape[2], query.device
    )  # once per forward: its layers share the mask
    key, value = layout.apply(key, value)
    if (
        q_len == 1 and heads // key.shape[1] <= ROW_BLOCK
    ):  # a decode step (invariant_decode.py): the same bits, fewer products
        return one_query_per_sequence(query, key, value, layout, scale), None
    return tiled_attention(query, key, value, layout.allowed, scale).transpose(1, 2), None


def tiled_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[B, H, q, d]`` attention of ``query`` ``[B, H, q, d]`` over ``key``/``value`` ``[B, G, width, d]``
    aligned to each sequence's start (whole ``KEY_BLOCK`` blocks), ``allowed`` ``[B, q, width]``."""
    batch, heads, q_len, dim = query.shape
    groups, width = key.shape[1], key.shape[2]
    repeat = heads // groups  # query heads per key/value head (grouped-query attention)
    blocks = width // KEY_BLOCK
    # the rows of a key/value head: its query heads x positions, tiled 16 at a time (a decode step's
    # heads share a tile); no key is copied per query head
    rows = repeat * q_len
    row_allowed = allowed[:, None].expand(batch, repeat, q_len, width).reshape(batch, 1, rows, width)
    q_extra = -rows % ROW_BLOCK
    tiles = (rows + q_extra) // ROW_BLOCK
    tall = tall_products_keep_tile_bits(dim, query.dtype, torch.get_num_threads())
    q_rows = F.pad(query.reshape(batch, groups, rows, dim), (0, 0, 0, q_extra))  # [B, G, tiles * 16, d]
    # one [16, d] x [d, width] product per tile: a score's bits do not depend on how many key
    # columns share the product (measured: equal to 64-key blocks, tests/modeling/test_batch_invariant.py);
    # where the probe allows, one tall product per key/value head gives every tile's bits
    # without copying its keys once per tile
    if tall:
        scores = torch.matmul(q_rows, key.transpose(-1, -2))  # [B, G, tiles * 16, width]
    else:
        scores = torch.matmul(
            q_rows.reshape(batch, groups, tiles, ROW_BLOCK, dim), key.transpose(-1, -2)[:, :, None]
        )  # [B, G, tiles, 16, width]
    scores = scores.reshape(batch, groups, tiles * ROW_BLOCK, width)[:, :, :rows] * scale
    live = row_allowed.any(-1, keepdim=True)  # a padding query sees nothing: zeros, never NaN
    scores = scores.masked_fill(~row_allowed, float("-inf")).masked_fill(~live, 0.0)
    probs = torch.softmax(scores, dim=-1).masked_fill(~row_allowed, 0.0)
    probs = F.pad(probs, (0, 0, 0, q_extra))
    if tall:  # per key block, one [tiles * 16, 64] x [64, d] product
        p_blocks = probs.reshape(batch, groups, tiles * ROW_BLOCK, blocks, KEY_BLOCK).transpose(2, 3)
        parts = torch.matmul(
            p_blocks, value.reshape(batch, groups, blocks, KEY_BLOCK, dim)
        )  # [B, G, blocks, tiles * 16, d]
        block = lambda b: parts[:, :, b]  # noqa: E731
    else:
        p_tiles = probs.reshape(batch, groups, tiles, ROW_BLOCK, blocks, KEY_BLOCK).transpose(3, 4)
        parts = torch.matmul(
            p_tiles, value.reshape(batch, groups, 1, blocks, KEY_BLOCK, dim)
        )  # [B, G, tiles, blocks, 16, d]
        block = lambda b: parts[:, :, :, b]  # noqa: E731
    out = block(0)
    for b in range(1, blocks):  # position order, the same on both sides; empty blocks add exact zeros
        out = out + block(b)
    out = out.reshape(batch, groups, tiles * ROW_BLOCK, dim)[:, :, :rows]
    return out.reshape(batch, heads, q_len, dim)


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
    under the plan probed for each weight shape on this CPU (modeling/invariant_products.py)."""
    return invariant_linear(kernel)


def make_batch_invariant(model: nn.Module, kernel: str = "torch") -> nn.Module:
    """Batch-invariant linears (on ``kernel``) and attention for ``model`` (a Hugging Face causal LM), in place.
    The engine and the trainer of one run must pass the same kernel. Every linear shape is probed
    first: a CPU on which some shape has no invariant product is refused here, by name."""
    model_plans(model, kernel)
    _register()
    use_linear(model, batch_invariant_linear(kernel))
    model.set_attn_implementation(ATTENTION)
    return model
