"""The engine's KV memory: every layer's keys and values in one pool of fixed-size blocks.

A sequence holds a list of blocks (its block table, engine/paged_cache.py); position p of it is
offset ``p % block_size`` of its block ``p // block_size``. Blocks are counted by reference: a
finished sequence's blocks pass to the prefix cache (engine/prefix_cache.py) without a copy (a
later prompt that begins with a cached prefix reads them into its prefill; a cached block is never
written again). A block returns to the pool when its last holder lets it go. This is the
layout of vLLM's paged KV cache and of SGLang's token pool with a page size; the page size is
SGLang's ``--page-size``.

Storage is ``[2, kv_heads, blocks + 1, block_size, head_dim]`` per layer (keys and values of a layer gathered
by one index), made on first use at the budget's size. On a CPU it is anonymous ``mmap`` memory: zero-filled
by the operating system and backed only where a block has been written, so the memory a process holds follows
the blocks in use, and the lowest free blocks go first to keep it compact (private memory, not reserved: a
fresh page faults in at a third of a shared one's cost; on 2 MiB pages, ``MADV_HUGEPAGE``, a GRPO-shape
rollout on a Zen 5 EPYC ran some 6% slower, so they stay 4 KiB); elsewhere it is allocated zeroed. Block 0 is
never handed out: it pads the tables of shorter rows up to a step's width (a masked key must be finite, and a
block once written keeps some sequence's finite values). Rows can ask for their reservations as runs of
consecutive blocks at one pitch (``allocate_rows``): such rows are attended in place, without a gather,
whatever their own lengths. When no block is held (a weight update empties the prefix cache) the memory goes
back: on Linux lazily (``MADV_FREE``: the kernel takes the pages when memory runs short, a colocated trainer's
allocations first, and until then the next rollout writes them without a fault: some 20,000 faults a GRPO-shape
rollout of SmolLM2 spared), elsewhere, and for a device's storage, by dropping the storage.
"""

from __future__ import annotations

import math
import mmap
import platform
import sys
from typing import Protocol

import numpy as np
import torch

from ..errors import EngineError

# Linux's MAP_NORESERVE on x86-64 and ARM (Python 3.11's mmap module does not name it)
NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" and platform.machine() in (
    "x86_64", "aarch64", "arm64") else None)  # fmt: skip


# Linux's MADV_FREE (4.5 on): freed private pages the kernel reclaims only under memory pressure; a write before
# then keeps a page, and a reclaimed page reads as zeros again (either way a block holds finite values)
LAZY_FREE = getattr(mmap, "MADV_FREE", None) if NORESERVE is not None else None


def storage_flags() -> int:
    """The CPU storage's mapping: private anonymous memory, not reserved, where the flag is known; shared anonymous
    (mmap's default) elsewhere. Reserved private memory would be counted whole against the machine's memory at every
    ``fork`` (a child's copy-on-write share of the budget), and a process holding pools larger than its memory
    could no longer fork: Python's multiprocessing, a test runner's workers."""
    if NORESERVE is None:
        return mmap.MAP_SHARED | mmap.MAP_ANONYMOUS
    return mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | NORESERVE


class IdleHolder(Protocol):
    def held(self, blocks: int) -> np.ndarray:
        """How many of its holds each of the pool's ``blocks`` blocks has."""

    def give_way(self) -> bool:
        """Let some blocks go (the oldest entry); False where it holds none."""


class BlockPool:
    def __init__(self, num_layers: int, block_size: int, max_tokens: int):
        if block_size < 1:
            raise EngineError(f"page_size: must be >= 1, got {block_size}")
        self.num_layers = num_layers
        self.block_size = block_size
        self.blocks = max(1, max_tokens // block_size)  # handed out at most; block 0 (zeros) comes on top
        self.storage: list[torch.Tensor] | None = None  # per layer [2, kv_heads, blocks + 1, block_size, head_dim]
        self._maps: list[mmap.mmap] = []  # the CPU storage's memory
        self.refs = np.zeros(self.blocks + 1, np.int32)
        self.refs[0] = 1  # block 0 is the pool's own
        self._high = 1  # blocks from here on are free (a bound on the search for free ones)
        self.used = 0  # blocks held by someone
        # the holder of idle blocks that can give them up (the prefix cache: engine.py sets it)
        self.idle: IdleHolder | None = None
        self._giving_way = False

    @property
    def free(self) -> int:
        return self.blocks - self.used

    def ensure(self, kv_heads: int, head_dim: int, dtype: torch.dtype, device) -> None:
        """The storage, made at the first write (the model's shapes are known then)."""
        if self.storage is not None:
            held = self.storage[0]
            if self.used == 0 and (held.shape[1] != kv_heads or held.shape[4] != head_dim or held.dtype != dtype):
                self.storage, self._maps = None, []  # idle memory kept for reuse, of other shapes: made anew
                return self.ensure(kv_heads, head_dim, dtype, device)
            if held.shape[1] != kv_heads or held.shape[4] != head_dim or held.dtype != dtype:
                raise EngineError(
                    f"block pool: keys of {kv_heads} heads x {head_dim} {dtype} written into a pool of "
                    f"{held.shape[1]} x {held.shape[4]} {held.dtype}"
                )
            return
        shape = (2, kv_heads, self.blocks + 1, self.block_size, head_dim)
        if torch.device(device).type == "cpu":
            size = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            # zero-filled, backed when written; private: a first write to a page faults in 1.4 instead of 3.8 us as
            # shared memory (mmap's default), and a rollout's first pass over fresh blocks faults some 20,000 pages
            self._maps = [mmap.mmap(-1, size, flags=storage_flags()) for _ in range(self.num_layers)]
            self.storage = [torch.frombuffer(m, dtype=dtype).view(shape) for m in self._maps]
        else:
            self.storage = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(self.num_layers)]

    def allocate(self, n: int) -> list[int]:
        """``n`` free blocks, lowest first, each held once; admission reserved them, so running out is a bug."""
        self._check(n)
        low = np.flatnonzero(self.refs[1 : self._high] == 0)[:n] + 1
        ids = low.tolist() + list(range(self._high, self._high + n - low.size))
        self._high = max(self._high, ids[-1] + 1) if ids else self._high
        return self._hold(ids)

    def allocate_rows(self, sizes: list[int]) -> list[list[int]] | None:
        """Runs of ``sizes[i]`` consecutive free blocks, row i's starting ``i * pitch`` blocks after row 0's
        (``pitch``: the largest size), the lowest such start; None where there is none. Only the rows' own
        blocks are held: the blocks between a shorter run and the next row's stay free for anyone, and a
        view at the pitch reads them only at positions its rows mask (finite values: zeros, or some row's).

        Where no window is free but one would be without the idle holder's blocks (the prefix cache: entries
        kept across rollouts without a weight update sit between the freed rows and break every window), its
        oldest entries give way until one is: rows not in place leave the layer loop (engine/fused_step.py)."""
        self._check(sum(sizes))
        start = self._window(sizes, self.refs[1 : self._high] == 0)
        if start is None and self.idle is not None:
            idle = self.idle.held(self.blocks + 1)[1 : self._high]
            if self._window(sizes, self.refs[1 : self._high] == idle) is not None:
                self._giving_way = True  # the storage stays while the entries go: these rows are about to use it
                try:
                    while start is None and self.idle.give_way():
                        start = self._window(sizes, self.refs[1 : self._high] == 0)
                finally:
                    self._giving_way = False
        if start is None:
            return None
        pitch = max(sizes)
        rows = [list(range(start + i * pitch, start + i * pitch + size)) for i, size in enumerate(sizes)]
        self._high = max(self._high, rows[-1][-1] + 1)
        self._hold([b for row in rows for b in row])
        return rows

    def _window(self, sizes: list[int], free: np.ndarray) -> int | None:
        """The lowest first block of rows ``sizes`` at one pitch where ``free`` (of blocks 1 .. high mark - 1; all
        from the high mark on are free) holds all their blocks, or None."""
        pitch = max(sizes)
        span = pitch * len(sizes)  # the in-place view's extent: within the storage
        free = np.concatenate([free, np.ones(span, bool)])
        counts = np.concatenate([[0], np.cumsum(free)])
        # block 1 + s for s below the high mark (from it on all is free): every window lies within ``counts``
        starts = np.arange(min(self._high, self.blocks + 1 - span))
        ok = np.ones(starts.size, bool)
        for i, size in enumerate(sizes):
            lo = starts + i * pitch
            ok &= counts[lo + size] - counts[lo] == size
        found = np.flatnonzero(ok)
        return int(found[0]) + 1 if found.size else None

    def _check(self, n: int) -> None:
        if n > self.free:
            raise EngineError(
                f"block pool: {n} blocks asked with {self.free} of {self.blocks} free (admission should have "
                "kept the request waiting)"
            )
        if self.storage is None:
            raise EngineError("block pool: blocks asked before the storage was made (ensure comes first)")

    def _hold(self, ids: list[int]) -> list[int]:
        self.refs[ids] = 1
        self.used += len(ids)
        return ids

    def share(self, ids: list[int]) -> None:
        """One more holder for each block (the prefix cache, a prompt that begins with a cached prefix)."""
        if ids:
            self.refs[ids] += 1

    def release(self, ids: list[int]) -> None:
        """One holder less for each block; a block nobody holds is free again."""
        if ids:
            index = np.asarray(ids)
            np.subtract.at(self.refs, index, 1)
            if (self.refs[index] < 0).any():
                raise EngineError(
                    f"block pool: block {int(index[self.refs[index] < 0][0])} released more often than held"
                )
            self.used -= int(np.unique(index[self.refs[index] == 0]).size)
        if self.used == 0 and not self._giving_way:  # nothing held: the memory goes back
            self._high = 1
            if not (LAZY_FREE is not None and self._maps and self._free_lazily(ids)):
                self.storage, self._maps = None, []

    def _free_lazily(self, ids: list[int]) -> bool:
        """The storage's pages freed lazily (mapped until the kernel needs them: no faults till then); False where
        the kernel refuses (one older than Python's headers: the storage is dropped instead)."""
        try:
            for memory in self._maps if ids else []:
                memory.madvise(LAZY_FREE)
        except OSError:
            return False
        return True

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

    def strided(self, layer: int, first: int, stride: int, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[rows, kv_heads, width, d]`` of rows whose positions start at block ``first +
        r * stride`` and run on through consecutive blocks: views of the storage, nothing copied."""
        s = self.storage[layer]
        _, heads, blocks, page, dim = s.shape
        head, row = blocks * page * dim, stride * page * dim
        base = s.storage_offset() + first * page * dim
        k = s.as_strided((rows, heads, width, dim), (row, head, dim, 1), base)
        v = s.as_strided((rows, heads, width, dim), (row, head, dim, 1), base + heads * head)
        return k, v
