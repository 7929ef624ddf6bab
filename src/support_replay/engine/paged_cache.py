"""The running rows' keys and values: a block table per row over the engine's block pool.

Row b's token at position p lives at offset ``p % page`` of block ``table[b][p // page]``
(engine/block_pool.py). A decode step writes each row's new key and value at its own position in
place, then gathers, layer by layer, every row's blocks into one ``[B, kv_heads, width, d]`` view
for the attention (one ``index_select`` per layer into a buffer every layer reuses: the attention
of layer l is done before layer l + 1 gathers). Rows shorter than the step's width are padded with
the pool's zero block. The view holds, position for position, what a rectangle of slots would
hold, and its last two dimensions have the same strides, so the attention returns the same bits.

Joining and leaving copy nothing: a prefilled group's rows are written into their blocks once, a
merge concatenates tables, a leaving row lets its blocks go (or passes them to the prefix cache).
A row's blocks are taken as it grows, within what admission reserved for it (engine/kv_budget.py).

It plugs into a Hugging Face model as its ``Cache``: the model calls ``update`` with each layer's
new keys and values; the runner says beforehand where they go (``prepare_decode``) and passes its
own ``[B, 1, 1, width]`` attention mask, so the library derives nothing from the cache's length.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import EngineError
from .block_pool import BlockPool


class PagedLayer(CacheLayerMixin):
    """One layer: ``update`` writes the decode step's position of every row and returns the gathered view."""

    is_sliding = False

    def __init__(self, owner: PagedCache, index: int):
        super().__init__()
        self.owner, self.index = owner, index
        self.is_initialized = True

    def lazy_initialization(self, key_states, value_states) -> None:
        raise EngineError("paged cache: a layer was written before its rows were prefilled")

    def update(self, key_states, value_states, *args, **kwargs):
        self.owner.write(self.index, key_states, value_states)
        return self.owner.attended(self.index)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.width, 0

    def get_seq_length(self) -> int:
        return max(self.owner.width - 1, 0)

    def get_max_length(self) -> int:
        return -1


class PagedCache(Cache):
    """``size`` rows, each with its block table and length, over ``pool``."""

    def __init__(self, pool: BlockPool, align: int = 1):
        self.pool = pool
        self.align = align  # the attended width is a multiple of this (the batch-invariant attention's key block)
        layers = [PagedLayer(self, i) for i in range(pool.num_layers)]
        super().__init__(layers=layers)
        self.tables: list[list[int]] = []
        self.lengths = torch.zeros(0, dtype=torch.long)  # tokens held per row (the next write position)
        self.width = 0  # positions the current step attends to
        self._write = torch.zeros(0, dtype=torch.long)  # this step's flat write index per row
        self._gather = torch.zeros(0, dtype=torch.long)  # this step's blocks, row-major, padded with block 0
        self._buffer: torch.Tensor | None = None  # the gathered keys and values, reused by every layer

    @property
    def size(self) -> int:
        return len(self.tables)

    @property
    def blocks_held(self) -> int:
        return sum(len(t) for t in self.tables)

    # ---- rows in ---------------------------------------------------------------------------------

    def append(
        self,
        per_layer: list[tuple[torch.Tensor, torch.Tensor]],
        lengths: list[int],
        sources: list[int] | None = None,
        shared: list[int] | None = None,
    ) -> None:
        """New rows from a left-padded prefill: ``per_layer`` holds ``[n, kv_heads, L, d]`` keys and
        values, new row i copies prefill row ``sources[i]`` (default i), whose ``lengths[i]`` real
        tokens are its last positions. ``shared`` (one row only): cached blocks the row's table begins
        with, already holding its first ``len(shared) * page`` positions (a prefix-cache hit)."""
        sources = list(range(len(lengths))) if sources is None else sources
        shared = shared or []
        if shared and len(lengths) != 1:
            raise EngineError("paged cache: shared blocks are for one row at a time")
        k0 = per_layer[0][0]
        pool, page = self.pool, self.pool.block_size
        pool.ensure(k0.shape[1], k0.shape[3], k0.dtype, k0.device)
        width = k0.shape[2]
        start = len(shared) * page  # positions before it are in the shared blocks
        dest, src = [], []
        for i, (row, length) in enumerate(zip(sources, lengths)):
            table = list(shared) + pool.allocate(-(-length // page) - len(shared))
            pool.share(shared)
            self.tables.append(table)
            dest.append(pool.slots(table, start, length))
            src.append(row * width + torch.arange(width - length + start, width))
        dest_index = torch.cat(dest).to(k0.device)
        src_index = torch.cat(src).to(k0.device)
        for layer, (k, v) in enumerate(per_layer):
            flat = pool.flat(layer)
            for part, values in ((0, k), (1, v)):
                rows = values.transpose(0, 1).reshape(values.shape[1], -1, values.shape[3])  # [heads, n * L, d]
                flat[part].index_copy_(1, dest_index, rows.index_select(1, src_index))
        self.lengths = torch.cat([self.lengths, torch.tensor(lengths, dtype=torch.long)])

    def extend(self, other: PagedCache) -> None:
        """``other``'s rows after the running ones (a newly prefilled group joining); ``other`` is left empty."""
        if other.pool is not self.pool:
            raise EngineError("paged cache: rows of another block pool cannot join")
        self.tables += other.tables
        self.lengths = torch.cat([self.lengths, other.lengths])
        other.tables, other.lengths = [], torch.zeros(0, dtype=torch.long)

    # ---- rows out --------------------------------------------------------------------------------

    def row_blocks(self, row: int) -> list[int]:
        """The blocks holding row ``row``'s positions (for the prefix cache to share)."""
        return self.tables[row][: -(-int(self.lengths[row]) // self.pool.block_size)]

    def keep(self, rows: list[int]) -> list[int]:
        """Only ``rows`` stay, in their order; the others let their blocks go. Returns ``rows``."""
        keep = set(rows)
        for i, table in enumerate(self.tables):
            if i not in keep:
                self.pool.release(table)
        self.tables = [self.tables[i] for i in rows]
        self.lengths = self.lengths[rows].clone() if rows else torch.zeros(0, dtype=torch.long)
        return list(rows)

    def release(self) -> None:
        """Every row out."""
        self.keep([])

    # ---- a decode step ---------------------------------------------------------------------------

    def prepare_decode(self) -> torch.Tensor:
        """Where this step's tokens go (each row's length), its gather, and the ``[B, 1, 1, width]`` mask."""
        pool, page = self.pool, self.pool.block_size
        lengths = self.lengths.tolist()
        growing = [i for i, n in enumerate(lengths) if n // page >= len(self.tables[i])]
        if growing:
            for i, block in zip(growing, pool.allocate(len(growing))):
                self.tables[i].append(block)
        device = pool.storage[0].device
        self.width = -(-(max(lengths) + 1) // self.align) * self.align
        blocks = -(-self.width // page)
        padded = [t[:blocks] + [0] * (blocks - len(t)) for t in self.tables]
        self._gather = torch.tensor(padded, dtype=torch.long).reshape(-1).to(device)
        own = torch.tensor([t[n // page] for t, n in zip(self.tables, lengths)], dtype=torch.long)
        self._write = (own * page + self.lengths % page).to(device)
        columns = self.lengths.to(device)
        mask = torch.arange(self.width, device=device)[None, :] <= columns[:, None]
        return mask[:, None, None, :]

    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A decode step's ``[B, kv_heads, 1, d]`` keys and values, row b at its own position."""
        flat = self.pool.flat(layer)
        flat[0].index_copy_(1, self._write, key_states[:, :, 0].transpose(0, 1))
        flat[1].index_copy_(1, self._write, value_states[:, :, 0].transpose(0, 1))

    def attended(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row's keys and values at positions ``0..width-1``, ``[B, kv_heads, width, d]`` each."""
        storage = self.pool.storage[layer]
        _, heads, _, page, dim = storage.shape
        rows, blocks = self.size, self._gather.numel() // max(self.size, 1)
        numel = 2 * heads * rows * blocks * page * dim
        if self._buffer is None or self._buffer.numel() != numel or self._buffer.dtype != storage.dtype:
            # exactly this step's rows x width: what admission counted (a larger one kept would not be)
            self._buffer = storage.new_empty(numel)
        out = self._buffer[:numel].view(2, heads, rows * blocks, page, dim)
        torch.index_select(storage, 2, self._gather, out=out)
        kv = out.view(2, heads, rows, blocks * page, dim)[:, :, :, : self.width].transpose(1, 2)
        return kv[0], kv[1]

    def finish_decode(self) -> None:
        self.lengths += 1
