"""The engine's KV cache: preallocated buffers, one slot per running sequence, columns by position.

Each layer holds keys and values as ``[slots, kv_heads, capacity, head_dim]``. Row b of the
running batch lives in slot b, and its token at position p in column p, so a decode step
writes one column per row in place (no concatenation of the whole cache at every step, as
Hugging Face's dynamic cache does) and attends to a view of the first ``width`` columns. A
sequence that joins is copied into the next free slot (its own rows only); one that leaves is
replaced by the last slot's sequence (that row only). The buffers grow by doubling, so a long
run reallocates a handful of times, never past the engine's KV budget (engine/kv_budget.py).

It plugs into a Hugging Face model as its ``Cache``: the model calls ``update`` with each
layer's new keys and values; the runner says beforehand where they go (``prepare_decode``)
and passes its own ``[B, 1, 1, width]`` attention mask, so the library derives nothing from
the cache's length.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import EngineError
from .kv_budget import plan_shape


class SlotLayer(CacheLayerMixin):
    """One layer's buffers; ``update`` writes the decode step's column of every row."""

    is_sliding = False

    def __init__(self):
        super().__init__()
        self.k: torch.Tensor | None = None  # [slots, kv_heads, capacity, head_dim]
        self.v: torch.Tensor | None = None
        self.owner: SlotCache | None = None

    def lazy_initialization(self, key_states, value_states) -> None:  # the buffers are made by SlotCache.reserve
        raise EngineError("slot cache: a layer was written before its buffers were reserved")

    def update(self, key_states, value_states, *args, **kwargs):
        owner = self.owner
        self.write(key_states, value_states)
        return self.k[: owner.size, :, : owner.width], self.v[: owner.size, :, : owner.width]

    def write(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A decode step's ``[B, kv_heads, 1, d]`` keys and values, row b at its own column."""
        index, d = self.owner.write_index, self.k.shape[-1]
        # one flat index for every layer (same shapes): a row copy, cheaper than a 2-D index_put
        self.k.view(-1, d).index_copy_(0, index, key_states.reshape(-1, d))
        self.v.view(-1, d).index_copy_(0, index, value_states.reshape(-1, d))

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return max(self.owner.width - 1, 0)

    def get_max_length(self) -> int:
        return -1  # grows on demand


class SlotCache(Cache):
    """The running batch's keys and values, ``size`` rows in slots ``0..size-1``."""

    def __init__(self, num_layers: int, align: int = 1, max_rows: int | None = None, max_tokens: int | None = None):
        self.align = align  # the attended width is a multiple of this (the batch-invariant attention's key block)
        self.max_rows = max_rows  # slots never double past the engine's batch size
        self.max_tokens = max_tokens  # the KV budget: held plus grown buffers never pass it (engine/kv_budget.py)
        layers = [SlotLayer() for _ in range(num_layers)]
        super().__init__(layers=layers)
        for layer in layers:
            layer.owner = self
        self.size = 0  # running rows
        self.lengths = torch.zeros(0, dtype=torch.long)  # tokens held per row (the next write column)
        self.width = 0  # columns the current step attends to
        self.write_index = torch.zeros(
            0, dtype=torch.long
        )  # row of a layer's [slots * kv_heads * capacity, d] view per (row, head)

    @property
    def slots(self) -> int:
        return 0 if self.layers[0].k is None else self.layers[0].k.shape[0]

    @property
    def capacity(self) -> int:
        return 0 if self.layers[0].k is None else self.layers[0].k.shape[2]

    def reserve(self, rows: int, columns: int, like: torch.Tensor) -> None:
        """At least ``rows`` slots of ``columns`` positions (doubling), keeping what is held."""
        held_shape = (self.slots, self.capacity)
        # only the dimension that ran out doubles (a longer row must not double the slots too), within the budget
        slots, capacity = plan_shape(held_shape, rows, columns, self.max_rows or rows, self.max_tokens)
        if (slots, capacity) == held_shape:
            return
        if self.max_tokens is not None and held_shape[0] * held_shape[1] + slots * capacity > self.max_tokens:
            raise EngineError(
                f"slot cache: {slots} x {capacity} positions beside the {held_shape[0]} x {held_shape[1]} held pass "
                "the KV "
                f"budget of {self.max_tokens} (admission should have kept them out)"
            )
        self._reallocate(slots, capacity, like)

    def shrink(self, columns: int) -> bool:
        """Down to ``columns`` positions per slot when that at least halves the capacity (the rows that
        needed the room have left) and the copy's peak stays within the budget; True if it did. Without
        it one long row, gone, would hold every later admission to its length. Slots stay: rows come
        and go all the time, and shrinking them would only make the next admission copy again."""
        columns = max(columns, int(self.lengths.max()) + 1 if self.size else 1)
        held, new = self.slots * self.capacity, self.slots * columns
        if (
            not self.size
            or 2 * columns > self.capacity
            or (self.max_tokens is not None and held + new > self.max_tokens)
        ):
            return False
        self._reallocate(self.slots, columns, self.layers[0].k)
        return True

    def _reallocate(self, slots: int, capacity: int, like: torch.Tensor) -> None:
        held = int(self.lengths.max()) if self.size else 0
        for layer in self.layers:
            shape = (slots, like.shape[1], capacity, like.shape[3])
            # zeros: a masked key's value must be finite, its weight 0 makes it add exact zeros
            k, v = like.new_zeros(shape), like.new_zeros(shape)
            if layer.k is not None:
                k[: self.size, :, :held] = layer.k[: self.size, :, :held]
                v[: self.size, :, :held] = layer.v[: self.size, :, :held]
            layer.k, layer.v = k, v
            layer.is_initialized = True

    def append(
        self, per_layer: list[tuple[torch.Tensor, torch.Tensor]], lengths: list[int], sources: list[int] | None = None
    ) -> None:
        """New rows after the running ones, from a left-padded prefill: ``per_layer`` holds
        ``[n, kv_heads, L, d]`` keys and values, new row i copies prefill row ``sources[i]`` (default
        i), whose ``lengths[i]`` real tokens are its last columns."""
        sources = list(range(len(lengths))) if sources is None else sources
        self.reserve(self.size + len(lengths), max(lengths) + 1, per_layer[0][0])
        for layer, (k, v) in zip(self.layers, per_layer):
            width = k.shape[2]
            for i, (src, length) in enumerate(zip(sources, lengths)):
                layer.k[self.size + i, :, :length] = k[src, :, width - length :]
                layer.v[self.size + i, :, :length] = v[src, :, width - length :]
        self.lengths = torch.cat([self.lengths, torch.tensor(lengths, dtype=torch.long)])
        self.size += len(lengths)

    def extend(self, other: SlotCache) -> None:
        """``other``'s rows after the running ones (a newly prefilled group joining)."""
        if other.size == 0:
            return
        self.reserve(self.size + other.size, int(other.lengths.max()) + 1, other.layers[0].k)
        for mine, theirs in zip(self.layers, other.layers):
            for i in range(other.size):
                held = int(other.lengths[i])
                mine.k[self.size + i, :, :held] = theirs.k[i, :, :held]
                mine.v[self.size + i, :, :held] = theirs.v[i, :, :held]
        self.lengths = torch.cat([self.lengths, other.lengths])
        self.size += other.size

    def keep(self, rows: list[int]) -> list[int]:
        """Only ``rows`` stay; each leaving row's slot takes the last remaining row (copied alone).
        Returns the kept rows' old indices in their new slot order."""
        keep = set(rows)
        order = list(range(self.size))
        for hole in sorted(set(order) - keep):
            while order and order[-1] not in keep:
                order.pop()
            if hole >= len(order):
                continue
            last = len(order) - 1  # a tail slot: never a move's target, it still holds its own row
            held = int(self.lengths[last])
            for layer in self.layers:
                layer.k[hole, :, :held] = layer.k[last, :, :held]
                layer.v[hole, :, :held] = layer.v[last, :, :held]
            self.lengths[hole] = self.lengths[last]
            order[hole] = order[last]
            order.pop()
        while order and order[-1] not in keep:
            order.pop()
        self.size = len(order)
        self.lengths = self.lengths[: self.size].clone()
        return order

    def prepare_decode(self) -> torch.Tensor:
        """Where this step's tokens go (column = each row's length) and the ``[B, 1, 1, width]`` mask."""
        device = self.layers[0].k.device
        columns = self.lengths.to(device)
        self.width = -(-(int(self.lengths.max()) + 1) // self.align) * self.align
        self.reserve(self.size, self.width, self.layers[0].k)
        _, heads, capacity, _ = self.layers[0].k.shape
        slot_rows = (
            torch.arange(self.size, device=device)[:, None] * (heads * capacity)
            + torch.arange(heads, device=device)[None, :] * capacity
        )
        self.write_index = (slot_rows + columns[:, None]).reshape(-1)
        mask = torch.arange(self.width, device=device)[None, :] <= columns[:, None]
        return mask[:, None, None, :]

    def finish_decode(self) -> None:
        self.lengths += 1
