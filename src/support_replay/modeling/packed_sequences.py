"""The sequences of the trainer's packed rows, laid out one row each for sdpa's attention.

A packed row (train/batches.py: ``build_packed_micro_batch``) holds a prompt once and then each
of its responses; response j attends to the prompt and to its own earlier tokens. A boolean mask
over the whole packed row makes sdpa compute every query against every key of
the row, ``(P + G R)^2`` scores for a prompt of P tokens and G responses of R, where the
sequences alone need ``G (P + R)^2``: at 512-token responses in groups of 4, 3.5 times the
attention work. So the packed row is unpacked here for the attention only (``use_packed_attention``):
one virtual row per sequence whose keys are gathered in position order, and whose queries are the
tokens that sequence owns (the first response's row also owns the prompt's queries); the output is
scattered back to the packed columns, a padding column getting zeros. Per sequence, the packed row
costs what the unpacked rows cost in attention and keeps its savings everywhere else. Taking the
row apart has its own cost (gathers, a scatter,
query slots padded to the longest owner), so sdpa goes per sequence only where the scores it
saves are at least ``PER_SEQUENCE_GAIN`` times those it computes: measured
(bench/packed_scoring.py, groups of 4, 44-token prompt), per sequence is 8% slower at 32-token
responses, even at 64, 7% faster at 128 and 1.55x faster at 512. (True-on-policy mode's attention
needs none of this: it takes each query over the keys its mask row sees, kernels/invariant.py.)

``segments`` marks each packed column: -1 the prompt, j >= 0 response j, -2 padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

PACKED_SDPA = "support_replay_packed_sdpa"
PER_SEQUENCE_GAIN = 2.0  # sdpa per sequence when the packed rows' [L, L] scores are this many times the virtual rows'


@dataclass
class PackedLayout:
    rows: int  # packed rows
    length: int  # packed columns
    query_flat: torch.Tensor  # [S, Q] flat (row * length + column) index of each owned query; 0 where none
    query_valid: torch.Tensor  # [S, Q]
    key_flat: torch.Tensor  # [S, W] flat index of the key at each aligned position; 0 past the sequence
    allowed: (
        torch.Tensor
    )  # [S, Q, W] True where the query sees the key (a query slot with no query sees key 0: no empty softmax row)

    @property
    def saving(self) -> float:
        """The packed rows' ``[L, L]`` scores over the virtual rows' ``[Q, W]`` ones."""
        sequences, queries, width = self.allowed.shape
        return self.rows * self.length**2 / (sequences * queries * width)

    def gather(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``query`` ``[B, H, L, d]`` and ``key``/``value`` ``[B, G, L, d]`` as ``[S, H, Q, d]`` and
        ``[S, G, W, d]``."""
        return _take(query, self.query_flat), _take(key, self.key_flat), _take(value, self.key_flat)

    def scatter(self, out: torch.Tensor) -> torch.Tensor:
        """``out`` ``[S, H, Q, d]`` of the virtual rows as the packed rows' ``[B, L, H, d]``."""
        sequences, heads, queries, dim = out.shape
        values = out.transpose(1, 2)[self.query_valid]  # [owned queries, H, d]
        where = self.query_flat[self.query_valid]
        packed = out.new_zeros(self.rows * self.length, heads, dim).index_put((where,), values)
        return packed.reshape(self.rows, self.length, heads, dim)


def _take(x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
    batch, heads, length, dim = x.shape
    rows = x.transpose(1, 2).reshape(batch * length, heads, dim)
    return rows[flat.reshape(-1)].reshape(*flat.shape, heads, dim).transpose(1, 2)


def packed_layout(segments: torch.Tensor, align: int = 1) -> PackedLayout:
    """The virtual rows of packed rows marked by ``segments`` (``[B, L]``), their keys padded to a
    multiple of ``align``."""
    rows, length = segments.shape
    marks = segments.cpu()
    sequences: list[
        tuple[list[int], list[int], int]
    ] = []  # (key columns, owned query columns, first owned position), flat
    for b in range(rows):
        base = b * length
        prompt = [base + c for c in torch.nonzero(marks[b] == -1).flatten().tolist()]
        responses = sorted(int(j) for j in marks[b].unique().tolist() if j >= 0)
        if not responses and prompt:
            sequences.append((prompt, prompt, 0))
        for n, j in enumerate(responses):
            own = [base + c for c in torch.nonzero(marks[b] == j).flatten().tolist()]
            if n == 0:  # the first response's row owns the prompt's queries too
                sequences.append((prompt + own, prompt + own, 0))
            else:
                sequences.append((prompt + own, own, len(prompt)))
    count = len(sequences)
    queries = max(len(own) for _, own, _ in sequences)
    width = -(-max(len(keys) for keys, _, _ in sequences) // align) * align
    query_flat = torch.zeros(count, queries, dtype=torch.long)
    query_valid = torch.zeros(count, queries, dtype=torch.bool)
    positions = torch.zeros(count, queries, dtype=torch.long)
    key_flat = torch.zeros(count, width, dtype=torch.long)
    for s, (keys, own, first) in enumerate(sequences):
        key_flat[s, : len(keys)] = torch.tensor(keys)
        query_flat[s, : len(own)] = torch.tensor(own)
        query_valid[s, : len(own)] = True
        positions[s, : len(own)] = torch.arange(first, first + len(own))
    allowed = (
        torch.arange(width)[None, None, :] <= positions[:, :, None]
    )  # an empty slot sees key 0; its output is never scattered
    device = segments.device
    return PackedLayout(
        rows, length, query_flat.to(device), query_valid.to(device), key_flat.to(device), allowed.to(device)
    )


_last: tuple | None = None  # (segments, align, layout) of the last forward: its layers pass the same tensor


def packed_layout_for(segments: torch.Tensor, align: int = 1) -> PackedLayout:
    """``packed_layout(segments, align)``, derived once per segments object (a forward's layers share it)."""
    global _last
    last = _last
    if last is not None and last[0] is segments and last[1] == align:
        return last[2]
    layout = packed_layout(segments, align)
    _last = (segments, align, layout)  # one tuple, replaced whole: safe across threads
    return layout


def packed_sdpa_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, packed_segments=None, **kwargs
):
    """Hugging Face's sdpa attention, and over a packed batch's ``packed_segments`` one virtual row
    per sequence (``PackedLayout``): the same scores and outputs to float rounding, the attention
    work of the unpacked rows. Returns ``[B, L, H, d]`` as the model's attention functions do."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    layout = (
        None if packed_segments is None else packed_layout_for(packed_segments, align=1)
    )  # sdpa needs no whole key blocks
    if layout is None or layout.saving < PER_SEQUENCE_GAIN:  # the mask over the whole packed row: same math
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    q, k, v = layout.gather(query, key, value)
    kwargs.pop("is_causal", None)
    out, _ = sdpa_attention_forward(
        module, q, k, v, layout.allowed[:, None], dropout=dropout, scaling=scaling, is_causal=False, **kwargs
    )
    return layout.scatter(out.transpose(1, 2)), None


def use_packed_attention(model: nn.Module) -> bool:
    """A model on sdpa attends over packed rows per sequence (``packed_sdpa_attention``), in place;
    returns whether it does (other attention implementations are left as they are)."""
    if model.config._attn_implementation != "sdpa":
        return model.config._attn_implementation == PACKED_SDPA
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention)
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    model.set_attn_implementation(PACKED_SDPA)
    return True
