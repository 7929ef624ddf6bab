"""The fixed shapes of the batch-invariant attention and where each key sits in them.

Both sides of a true-on-policy run (the engine's gathered KV blocks, the trainer's
right-padded batch) cut keys into blocks of ``KEY_BLOCK`` positions counted from each
sequence's start and queries into tiles of ``ROW_BLOCK`` rows. ``key_layout`` says, for one
attention mask, which cache column holds each sequence position; a forward's layers share one
mask object, so the layout is derived once per forward (``layout_for``), not once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ROW_BLOCK = 16  # rows of every attention tile (and MKL's linear products: linear_kernels.INVARIANT_ROWS)
KEY_BLOCK = 64  # keys per attention block, counted from the sequence start


@dataclass
class KeyLayout:
    """Where each aligned position's key is, for one mask: index j holds sequence position j."""

    width: int  # aligned key columns, whole blocks
    allowed: torch.Tensor  # [B, q, width], True where a query sees the key
    index: torch.Tensor | None  # [B, width] source column per aligned position; None when already aligned
    k_len: int  # key columns of the cache or batch the layout was made for
    derived: dict = field(default_factory=dict)  # what the decode step derives from it once (invariant_decode.py)

    def apply(self, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``key`` and ``value`` ``[B, G, k_len, d]`` in this layout, padded to ``width`` (views where no shift is
        needed)."""
        if self.index is None:
            extra = self.width - self.k_len
            if extra > 0:
                key, value = F.pad(key, (0, 0, 0, extra)), F.pad(value, (0, 0, 0, extra))
            return key[:, :, : self.width], value[:, :, : self.width]
        batch, groups, _, dim = key.shape
        rows = self.index[:, None, :, None].expand(batch, groups, self.width, dim)
        return key.gather(2, rows), value.gather(2, rows)


def key_layout(allowed: torch.Tensor) -> KeyLayout:
    """The layout of ``allowed`` (``[B, q, k_len]``): a row's start is its first key any query may see."""
    k_len = allowed.shape[2]
    seen = allowed.any(1)  # [B, L]
    start = torch.where(seen.any(1), seen.int().argmax(1), 0)
    width = -(-int((k_len - start).max()) // KEY_BLOCK) * KEY_BLOCK
    if bool(
        (start == 0).all()
    ):  # already aligned (the trainer's batch; the engine's gathered blocks, whole key blocks wide): no gather
        extra = width - k_len
        aligned = F.pad(allowed, (0, extra)) if extra > 0 else allowed
        return KeyLayout(width, aligned[:, :, :width], None, k_len)
    index = start[:, None] + torch.arange(width, device=allowed.device)[None]
    inside = index < k_len
    index = index.clamp_max(k_len - 1)
    aligned = allowed.gather(2, index[:, None, :].expand(-1, allowed.shape[1], -1)) & inside[:, None, :]
    return KeyLayout(width, aligned, index, k_len)


_last: tuple | None = None  # (mask, q_len, k_len, layout) of the last forward: its layers share the mask object


def layout_for(attention_mask: torch.Tensor | None, batch: int, q_len: int, k_len: int, device) -> KeyLayout:
    """``key_layout`` of a Hugging Face attention mask (``[B, 1, q, k]``, boolean or additive; None
    for plain causal without padding), derived once per mask object. The entry holds the mask
    itself, so an identical object is the same mask (a mask is built per forward, never edited)."""
    global _last
    last = _last
    if attention_mask is not None and last is not None and last[0] is attention_mask and last[1:3] == (q_len, k_len):
        return last[3]
    if attention_mask is None:
        allowed = (
            torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)[None].expand(batch, -1, -1)
        )
    else:
        mask = attention_mask[:, 0]
        allowed = mask if mask.dtype == torch.bool else mask == 0
    layout = key_layout(allowed)
    if attention_mask is not None:
        _last = (attention_mask, q_len, k_len, layout)  # one tuple, replaced whole: safe across threads
    return layout
