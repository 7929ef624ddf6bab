"""The running rows' keys and values: a block table per row over the engine's block pool.

Row b's token at position p lives at offset ``p % page`` of block ``table[b][p // page]``
(engine/block_pool.py). A decode step writes each row's new key and value at its own position in
place, then attends, layer by layer, over views of its rows' blocks:

- rows prefilled together take their whole reservations as runs of consecutive blocks at one pitch,
  the largest reservation (``reserve``), one row after another: rows whose runs lie at one pitch (a
  GRPO batch, a bucket of prompts, whatever their lengths) are **attended in place**, a strided view
  of the storage, nothing copied;
- other rows (a pool too fragmented for a run) take blocks as they grow and are **gathered**: one
  ``index_select`` per layer into a buffer every layer reuses, rows of like length together at their
  own width, shorter rows padded with the pool's zero block.

Either view holds, position for position, what a rectangle of slots would, with the same inner
strides, so the attention returns the same bits as over a contiguous cache (the batch-invariant
attention at any width; sdpa's may move with the width within float rounding).

Joining and leaving copy nothing: a prefilled group's rows are written into their blocks once, a
merge concatenates tables, a leaving row lets its blocks go (or passes them to the prefix cache).

Rows copied from one prefill row (a GRPO group's samples of one prompt) hold the same keys and values at
the prompt's positions: an in-place group names, for each row, the first row of its prompt
(``AttentionGroup.shared``), and the decode kernel reads the prompt there, once from memory for the group
instead of once a row (the same numbers, so the same bits; a GRPO-shape step's attention on SmolLM2,
prompts of 39 tokens, 64 new: 2.76 -> 2.22 ms on a Zen 5 EPYC).

It plugs into a Hugging Face model as its ``Cache``: the model calls ``update`` with each layer's
new keys and values; the runner says beforehand where they go (``prepare_decode``) and passes its
own ``[B, 1, 1, width]`` attention mask, so the library derives nothing from the cache's length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from ..errors import EngineError
from .block_pool import BlockPool
from .kv_budget import round_up

GROUP_SPREAD = 2  # a row joins the longest row's attention group while its width is at least 1 / this of it


@dataclass
class AttentionGroup:
    """Rows whose attention runs together at one width: where their keys are, and their mask."""

    rows: torch.Tensor | None  # their indices in the batch; None: every row, in batch order
    size: int
    width: int
    mask: torch.Tensor  # [size, 1, 1, width], True where a key is seen
    gather: torch.Tensor | None = None  # [size * blocks] block ids, row-major, padded with block 0
    first: int = 0  # in place (gather None): the first row's first block, the next row's ``stride`` blocks on
    stride: int = 0
    # in place: [size, 2], each row's first row among the group's with the same prompt (its index there) and the
    # prompt's positions, 0 for that first row itself; None where no two rows share a prompt
    shared: torch.Tensor | None = None


def strided_runs(firsts: list[int | None], pitches: list[int]) -> list[tuple[list[int], int]]:
    """Rows that can be attended in place: ``(rows, stride)`` for every two or more rows (or one) whose
    reservations are runs laid ``stride`` blocks apart (their pitch), each starting ``stride`` blocks after
    the previous one (``firsts[i]`` None: row i is not a run)."""
    by_start = sorted((f, i) for i, f in enumerate(firsts) if f is not None)
    out: list[tuple[list[int], int]] = []
    for first, i in by_start:
        stride = pitches[i]
        if out and out[-1][1] == stride and firsts[out[-1][0][-1]] + stride == first:
            out[-1][0].append(i)
        else:
            out.append(([i], stride))
    return out


def attention_groups(lengths: list[int], align: int) -> list[list[int]]:
    """Rows in groups, longest first: a group takes every row whose width is at least ``1 / GROUP_SPREAD``
    of its longest row's, so no row is gathered at more than that many times its own width (a batch of
    like lengths, a GRPO rollout's, stays one group)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    groups: list[list[int]] = []
    for i in order:
        width = round_up(lengths[i] + 1, align)
        if groups and width * GROUP_SPREAD >= round_up(lengths[groups[-1][0]] + 1, align):
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


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
        self.align = align  # the attended width is a multiple of this
        layers = [PagedLayer(self, i) for i in range(pool.num_layers)]
        super().__init__(layers=layers)
        self.tables: list[list[int]] = []
        self.pitches: list[int] = []  # >0: the row's table is its whole reservation, consecutive blocks laid out
        # at this pitch beside the rows prefilled with it; 0: blocks taken as the row grows
        self.lengths = torch.zeros(0, dtype=torch.long)  # tokens held per row (the next write position)
        # per row (prompt, positions): rows of one prompt copied from one prefill row hold the same keys and values
        # at its positions (a GRPO group's samples); the attention reads them from one row of the group
        self.prompts: list[tuple[int, int]] = []
        self._prompt_count = 0
        self.width = 0  # positions the current step attends to
        self._write = torch.zeros(0, dtype=torch.long)  # this step's flat write index per row
        self.groups: list[AttentionGroup] = []  # this step's attention groups (one unless the step asked)
        self._buffer: torch.Tensor | None = None  # the gathered keys and values, reused by every layer and group

    @property
    def size(self) -> int:
        return len(self.tables)

    # ---- rows in ---------------------------------------------------------------------------------

    def append(
        self,
        per_layer: list[tuple[torch.Tensor, torch.Tensor]],
        lengths: list[int],
        sources: list[int] | None = None,
        reserve: list[int] | None = None,
    ) -> None:
        """New rows from a left-padded prefill: ``per_layer`` holds ``[n, kv_heads, L, d]`` keys and
        values, new row i copies prefill row ``sources[i]`` (default i), whose ``lengths[i]`` real
        tokens are its last positions. ``reserve``: each row's whole reservation in blocks, taken at
        once as runs at one pitch, the largest reservation, row after row, where the pool has them (else blocks
        as rows grow): rows of unlike reservations are then attended in place together."""
        sources = list(range(len(lengths))) if sources is None else sources
        k0 = per_layer[0][0]
        pool, page = self.pool, self.pool.block_size
        pool.ensure(k0.shape[1], k0.shape[3], k0.dtype, k0.device)
        width = k0.shape[2]
        runs = None
        if reserve is not None:
            if any(r * page < n for r, n in zip(reserve, lengths)):
                raise EngineError(f"paged cache: reservations {reserve} blocks do not hold prompts of {lengths}")
            runs = pool.allocate_rows(reserve)
        dest, src = [], []
        prompts: dict[tuple[int, int], int] = {}
        for i, (row, length) in enumerate(zip(sources, lengths)):
            table = runs[i] if runs is not None else pool.allocate(-(-length // page))
            self.tables.append(table)
            self.pitches.append(max(reserve) if runs is not None else 0)
            if (row, length) not in prompts:
                prompts[(row, length)] = self._prompt_count
                self._prompt_count += 1
            self.prompts.append((prompts[(row, length)], length))
            dest.append(pool.slots(table, 0, length))
            src.append(row * width + torch.arange(width - length, width))
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
        self.pitches += other.pitches
        # the other cache's prompt numbers, moved past this one's: a prompt of each stays its own
        self.prompts += [(self._prompt_count + prompt, length) for prompt, length in other.prompts]
        self._prompt_count += other._prompt_count
        self.lengths = torch.cat([self.lengths, other.lengths])
        other.tables, other.pitches, other.lengths = [], [], torch.zeros(0, dtype=torch.long)
        other.prompts, other._prompt_count = [], 0

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
        self.pitches = [self.pitches[i] for i in rows]
        self.prompts = [self.prompts[i] for i in rows]
        self.lengths = self.lengths[rows].clone() if rows else torch.zeros(0, dtype=torch.long)
        return list(rows)

    def release(self) -> None:
        """Every row out."""
        self.keep([])

    # ---- a decode step ---------------------------------------------------------------------------

    def prepare_decode(self, grouped: bool = False) -> torch.Tensor:
        """Where this step's tokens go (each row's length), its attention groups, and the
        ``[B, 1, 1, width]`` mask of all rows at the longest row's width. Without ``grouped`` (the
        module tree's decode) every row is one gathered group; with it (the fused step) rows whose
        reservations lie at one stride attend in place and the others are gathered in groups of like
        length: one long row no longer makes every row's attention that long."""
        pool, page = self.pool, self.pool.block_size
        lengths = self.lengths.tolist()
        growing = [i for i, n in enumerate(lengths) if n // page >= len(self.tables[i])]
        if any(self.pitches[i] for i in growing):
            raise EngineError("paged cache: a row wrote past its reservation")
        if growing:
            for i, block in zip(growing, pool.allocate(len(growing))):
                self.tables[i].append(block)
        device = pool.storage[0].device
        own = torch.tensor([t[n // page] for t, n in zip(self.tables, lengths)], dtype=torch.long)
        self._write = (own * page + self.lengths % page).to(device)
        everyone = list(range(len(lengths)))
        self.width = self._width(everyone, lengths)
        if not grouped:
            self.groups = [self._gathered(everyone, lengths, device, whole=True)]
        else:
            placed = strided_runs([t[0] if p else None for t, p in zip(self.tables, self.pitches)], self.pitches)
            rest = sorted(set(everyone) - {i for rows, _ in placed for i in rows})
            gathered = [[rest[j] for j in g] for g in attention_groups([lengths[i] for i in rest], self.align)]
            # one group holding every row in batch order: its output needs no scattering back
            alone = len(placed) + len(gathered) == 1
            self.groups = [
                self._in_place(rows, stride, lengths, device, alone and rows == everyone) for rows, stride in placed
            ]
            self.groups += [self._gathered(sorted(rows), lengths, device, alone) for rows in gathered]
        storage = pool.storage[0]
        heads, dim = storage.shape[1], storage.shape[4]
        numel = 2 * heads * dim * page * max([g.gather.numel() for g in self.groups if g.gather is not None] or [0])
        if not numel:
            self._buffer = None  # every row in place: no copy is kept
        elif self._buffer is None or self._buffer.numel() != numel or self._buffer.dtype != storage.dtype:
            # exactly this step's largest gathered group: within what admission counted for the step
            self._buffer = storage.new_empty(numel)
        if len(self.groups) == 1 and self.groups[0].rows is None:
            return self.groups[0].mask
        return self._mask(everyone, self.width, device)

    def _mask(self, rows: list[int], width: int, device) -> torch.Tensor:
        # every row in order (a rollout's step): the lengths as they are, no index built from the list
        columns = (
            self.lengths if len(rows) == len(self.lengths) and rows == list(range(len(rows))) else self.lengths[rows]
        )
        columns = columns.to(device)
        return (torch.arange(width, device=device)[None, :] <= columns[:, None])[:, None, None, :]

    def _width(self, rows: list[int], lengths: list[int]) -> int:
        """The positions ``rows`` attend to this step: their longest length and the write, a multiple of ``align``."""
        return round_up(max(lengths[i] for i in rows) + 1, self.align)

    def _gathered(self, rows: list[int], lengths: list[int], device, whole: bool) -> AttentionGroup:
        width = self._width(rows, lengths)
        blocks = -(-width // self.pool.block_size)
        padded = [self.tables[i][:blocks] + [0] * (blocks - len(self.tables[i])) for i in rows]
        gather = torch.tensor(padded, dtype=torch.long).reshape(-1).to(device)
        index = None if whole else torch.tensor(rows, dtype=torch.long, device=device)
        return AttentionGroup(index, len(rows), width, self._mask(rows, width, device), gather=gather)

    def _in_place(self, rows: list[int], stride: int, lengths: list[int], device, whole: bool) -> AttentionGroup:
        width = self._width(rows, lengths)
        if width > stride * self.pool.block_size:
            raise EngineError(f"paged cache: a width of {width} passes the rows' reservations of {stride} blocks")
        index = None if whole else torch.tensor(rows, dtype=torch.long, device=device)
        mask = self._mask(rows, width, device)
        first = self.tables[rows[0]][0]
        return AttentionGroup(index, len(rows), width, mask, first=first, stride=stride, shared=self._shared(rows))

    def _shared(self, rows: list[int]) -> torch.Tensor | None:
        """``AttentionGroup.shared`` of ``rows``: each row's first row among them with the same prompt and the
        prompt's positions (0 for that first row); None where every prompt is a single row's."""
        firsts: dict[int, int] = {}
        pairs = []
        for j, i in enumerate(rows):
            prompt, length = self.prompts[i]
            first = firsts.setdefault(prompt, j)
            pairs.append((first, length if first != j else 0))
        if len(firsts) == len(rows):
            return None
        return torch.tensor(pairs, dtype=torch.long)

    def write(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """A decode step's ``[B, kv_heads, 1, d]`` keys and values, row b at its own position."""
        flat = self.pool.flat(layer)
        flat[0].index_copy_(1, self._write, key_states[:, :, 0].transpose(0, 1))
        flat[1].index_copy_(1, self._write, value_states[:, :, 0].transpose(0, 1))

    @property
    def write_slots(self) -> torch.Tensor:
        """This step's write position of each row in a layer's flat ``[kv_heads, slots, d]`` keys and values ``[B]``."""
        return self._write

    def write_target(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Where a decode step's keys and values go: layer ``layer``'s keys and values ``[kv_heads, slots, d]``
        and each row's slot ``[B]`` (``write`` writes there; the fused step's compiled kernels write there too)."""
        flat = self.pool.flat(layer)
        return flat[0], flat[1], self._write

    def attended(self, layer: int, group: AttentionGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values of ``group``'s rows (default: every row, one group) at positions
        ``0..width-1``, ``[rows, kv_heads, width, d]`` each: views of the storage for rows in place,
        else a buffer the next gather overwrites."""
        if group is None:
            if len(self.groups) != 1 or self.groups[0].rows is not None:
                raise EngineError("paged cache: this step's rows are in attention groups; attend each")
            group = self.groups[0]
        if group.gather is None:
            return self.pool.strided(layer, group.first, group.stride, group.size, group.width)
        storage = self.pool.storage[layer]
        _, heads, _, page, dim = storage.shape
        picked = group.gather.numel()
        out = self._buffer[: 2 * heads * picked * page * dim].view(2, heads, picked, page, dim)
        torch.index_select(storage, 2, group.gather, out=out)
        kv = out.view(2, heads, group.size, -1, dim)[:, :, :, : group.width].transpose(1, 2)
        return kv[0], kv[1]

    def finish_decode(self) -> None:
        self.lengths += 1
