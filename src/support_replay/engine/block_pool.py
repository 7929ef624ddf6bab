"""The engine's KV memory: every layer's keys and values in one pool of fixed-size blocks.

A sequence holds a list of blocks (its block table, engine/paged_cache.py); position p of it is
offset ``p % block_size`` of its block ``p // block_size``. Blocks are counted by reference: a
finished sequence's blocks pass to the prefix cache (engine/prefix_cache.py) without a copy, and
a later prompt that begins with a cached prefix takes that prefix's whole blocks into its own
table (a block is only ever written at positions past every sharer's length, so a shared block
is never written). A block returns to the free list when its last holder lets it go. This is
the layout of vLLM's paged KV cache and of SGLang's token pool with a page size; the page size
is SGLang's ``--page-size``.

Storage is ``[2, kv_heads, blocks + 1, block_size, head_dim]`` per layer (keys and values of a
layer gathered by one index), made on first use at the budget's size with ``torch.empty``: the
operating system backs only the pages a block has been written to, and the lowest free blocks
are handed out first, so the memory a process holds follows the blocks in use. Block 0 is all
zeros and never handed out: it pads the tables of shorter rows up to the step's width (a masked
key must be finite). A block is zeroed the first time it is handed out; after that it holds
keys and values of some sequence (finite) wherever it is not written yet, which a mask hides.
When no block is held the storage is dropped (a colocated trainer gets the memory back).
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from ..errors import EngineError


class BlockPool:
    def __init__(self, num_layers: int, block_size: int, max_tokens: int):
        if block_size < 1:
            raise EngineError(f"page_size: must be >= 1, got {block_size}")
        self.num_layers = num_layers
        self.block_size = block_size
        self.blocks = max(1, max_tokens // block_size)  # handed out at most; block 0 (zeros) comes on top
        self.storage: list[torch.Tensor] | None = None  # per layer [2, kv_heads, blocks + 1, block_size, head_dim]
        self.refs = np.zeros(self.blocks + 1, np.int32)
        self._released: list[int] = []  # a heap of blocks handed out before and free again: lowest first
        self._next = 1  # blocks from here on were never handed out since the storage was made
        self.used = 0  # blocks held by someone

    @property
    def free(self) -> int:
        return self.blocks - self.used

    def ensure(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """The storage, made at the first write (the model's shapes are known then)."""
        if self.storage is not None:
            held = self.storage[0]
            if held.shape[1] != kv_heads or held.shape[4] != head_dim or held.dtype != dtype:
                raise EngineError(
                    f"block pool: keys of {kv_heads} heads x {head_dim} {dtype} written into a pool of "
                    f"{held.shape[1]} x {held.shape[4]} {held.dtype}"
                )
            return
        shape = (2, kv_heads, self.blocks + 1, self.block_size, head_dim)
        self.storage = [torch.empty(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]
        for layer in self.storage:
            layer[:, :, 0].zero_()

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, lowest first, each held once; admission reserved them, so running out is a bug."""
        if n > self.free:
            raise EngineError(
                f"block pool: {n} blocks asked with {self.free} of {self.blocks} free (admission should have "
                "kept the request waiting)"
            )
        if self.storage is None:
            raise EngineError("block pool: blocks asked before the storage was made (ensure comes first)")
        # released blocks first (the lowest), then never-used ones: the touched memory stays compact
        ids = [heapq.heappop(self._released) for _ in range(min(n, len(self._released)))]
        fresh = list(range(self._next, self._next + n - len(ids)))
        self._next += len(fresh)
        ids += fresh
        self.refs[ids] = 1
        self.used += n
        if fresh:  # zeroed the first time: the storage was made with torch.empty
            index = torch.tensor(fresh, device=self.storage[0].device)
            for layer in self.storage:
                layer.index_fill_(2, index, 0)
        return ids

    def share(self, ids: list[int]) -> None:
        """One more holder for each block (the prefix cache, a prompt that begins with a cached prefix)."""
        if ids:
            self.refs[ids] += 1

    def release(self, ids: list[int]) -> None:
        """One holder less for each block; a block nobody holds goes back to the free list."""
        for i in ids:
            self.refs[i] -= 1
            if self.refs[i] == 0:
                heapq.heappush(self._released, i)
                self.used -= 1
            elif self.refs[i] < 0:
                raise EngineError(f"block pool: block {i} released more often than it was held")
        if self.used == 0:  # nothing held: the memory goes back, and every block is new again
            self.storage, self._released, self._next = None, [], 1

    def flat(self, layer: int) -> torch.Tensor:
        """Layer ``layer``'s storage as ``[2, kv_heads, (blocks + 1) * page, head_dim]`` (block * page + offset)."""
        s = self.storage[layer]
        return s.view(2, s.shape[1], -1, s.shape[4])

    def slots(self, table: list[int], start: int, stop: int) -> torch.Tensor:
        """Flat indices of positions ``start..stop-1`` of a sequence with block table ``table``."""
        positions = torch.arange(start, stop)
        blocks = torch.tensor(table, dtype=torch.long)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def read(self, table: list[int], length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A sequence's first ``length`` positions: per layer ``(keys, values)``, ``[kv_heads, length, d]`` copies."""
        index = self.slots(table, 0, length).to(self.storage[0].device)
        out = []
        for layer in range(self.num_layers):
            kv = self.flat(layer).index_select(2, index)
            out.append((kv[0], kv[1]))
        return out
