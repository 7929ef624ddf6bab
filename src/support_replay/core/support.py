"""SupportTable: the realized sampling support S_t of every generated token, in CSR form.

Row t holds the token ids whose post-filter weight was > 0 when token t was sampled.
Storage is two numpy arrays: ``ids`` (int32, ids of row t are ``ids[offsets[t]:offsets[t+1]]``)
and ``offsets`` (int64, ``len(offsets) == rows + 1``). Ids inside a row are kept sorted
ascending (the canonical form; engines return other orders), which makes equality,
duplicate checks and membership tests cheap and the wire encoding compact.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from ..errors import SupportError

_ID_LIMIT = np.iinfo(np.int32).max


def offsets_from_sizes(sizes) -> np.ndarray:
    """CSR offsets (int64, starting at 0) of rows of the given sizes."""
    sizes = np.asarray(sizes, dtype=np.int64)
    offsets = np.zeros(len(sizes) + 1, dtype=np.int64)
    np.cumsum(sizes, out=offsets[1:])
    return offsets


def _as_int_array(values, name: str, dtype) -> np.ndarray:
    if isinstance(values, np.ndarray) and values.dtype == dtype and values.ndim == 1:
        return values  # already what is kept: every value fits (an engine step's support, once per step)
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    arr = np.asarray(values)
    if arr.size == 0:
        return np.zeros(0, dtype=dtype)
    if arr.ndim != 1:
        raise SupportError(f"{name}: expected a 1-D array, got shape {arr.shape}")
    if not np.issubdtype(arr.dtype, np.integer):
        raise SupportError(f"{name}: expected integers, got dtype {arr.dtype}")
    if arr.min() < np.iinfo(dtype).min or arr.max() > np.iinfo(dtype).max:
        raise SupportError(f"{name}: value {int(arr.max())} does not fit in {np.dtype(dtype).name}")
    return arr.astype(dtype, copy=False)


def _row_index(offsets: np.ndarray) -> np.ndarray:
    """Row number of every stored id (offsets assumed non-decreasing)."""
    return np.repeat(np.arange(len(offsets) - 1, dtype=np.int64), np.diff(offsets))


class SupportTable:
    """Per-token sampling supports of one sample (or a concatenation of samples).

    Construct with ``from_lists``, ``from_padded``, ``from_csr`` or ``singleton``; the
    plain constructor takes arrays as they are (no sorting) and is meant for code that
    already holds canonical arrays, such as the wire decoder.
    """

    __slots__ = ("ids", "offsets")

    def __init__(self, ids, offsets):
        self.ids = _as_int_array(ids, "ids", np.int32)
        self.offsets = _as_int_array(offsets, "offsets", np.int64)
        if len(self.offsets) == 0:
            raise SupportError("offsets: must have rows + 1 entries, got an empty array")

    # ---- constructors -------------------------------------------------------------

    @classmethod
    def from_csr(cls, ids, offsets) -> SupportTable:
        """Canonicalise CSR arrays: checks the offsets' structure, sorts every row."""
        table = cls(ids, offsets)
        table._check_structure()
        return table._sorted_rows()

    @classmethod
    def from_lists(cls, rows: Iterable[Sequence[int]]) -> SupportTable:
        rows = list(rows)
        sizes = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))
        offsets = offsets_from_sizes(sizes)
        try:
            flat = np.fromiter((int(i) for r in rows for i in r), dtype=np.int64, count=int(offsets[-1]))
        except OverflowError:
            bad = next(int(i) for r in rows for i in r if not -(2**63) <= int(i) < 2**63)
            raise SupportError(f"id {bad} is not a valid token id") from None
        if flat.size and (flat.min() < 0 or flat.max() > _ID_LIMIT):
            bad = int(flat[(flat < 0) | (flat > _ID_LIMIT)][0])
            row = int(np.searchsorted(offsets, np.flatnonzero((flat < 0) | (flat > _ID_LIMIT))[0], "right") - 1)
            raise SupportError(f"row {row}: id {bad} is not a valid token id")
        return cls.from_csr(flat.astype(np.int32), offsets)

    @classmethod
    def from_padded(cls, ids, lengths) -> SupportTable:
        """From padded ``ids[T, K]`` where row t uses its first ``lengths[t]`` entries."""
        if isinstance(ids, torch.Tensor):
            ids = ids.detach().cpu().numpy()
        ids = np.asarray(ids)
        lengths = _as_int_array(lengths, "lengths", np.int64)
        if ids.ndim != 2 or ids.shape[0] != len(lengths):
            raise SupportError(f"from_padded: ids shape {ids.shape} does not match {len(lengths)} lengths")
        if len(lengths) and (lengths.min() < 0 or lengths.max() > ids.shape[1]):
            t = int(np.flatnonzero((lengths < 0) | (lengths > ids.shape[1]))[0])
            raise SupportError(f"row {t}: length {int(lengths[t])} outside [0, {ids.shape[1]}]")
        keep = np.arange(ids.shape[1])[None, :] < lengths[:, None]
        offsets = offsets_from_sizes(lengths)
        return cls.from_csr(_as_int_array(ids[keep], "ids", np.int32), offsets)

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> SupportTable:
        """From a boolean ``[T, V]`` mask (ids come out ascending, already canonical)."""
        rows, cols = torch.nonzero(mask, as_tuple=True)
        offsets = offsets_from_sizes(mask.sum(-1).cpu().numpy())
        return cls(cols.to(torch.int32).cpu().numpy(), offsets)

    @classmethod
    def from_rows(cls, rows: Sequence[np.ndarray]) -> SupportTable:
        """From canonical (ascending, int32) id arrays, one per row, without re-sorting."""
        offsets = offsets_from_sizes([len(r) for r in rows])
        ids = np.concatenate(rows).astype(np.int32, copy=False) if rows else np.zeros(0, np.int32)
        return cls(ids, offsets)

    @classmethod
    def singleton(cls, tokens) -> SupportTable:
        """Support ``{a_t}`` for every row: inserted (environment, tool) tokens, greedy steps."""
        tokens = _as_int_array(tokens, "tokens", np.int32)
        return cls(tokens.copy(), np.arange(len(tokens) + 1, dtype=np.int64))

    @classmethod
    def empty(cls) -> SupportTable:
        return cls(np.zeros(0, np.int32), np.zeros(1, np.int64))

    # ---- shape --------------------------------------------------------------------

    @property
    def num_rows(self) -> int:
        return len(self.offsets) - 1

    def __len__(self) -> int:
        return self.num_rows

    @property
    def nnz(self) -> int:
        return len(self.ids)

    def sizes(self) -> np.ndarray:
        """|S_t| for every row (int64)."""
        return np.diff(self.offsets)

    def max_size(self) -> int:
        return int(self.sizes().max()) if self.num_rows else 0

    def row(self, t: int) -> np.ndarray:
        if not -self.num_rows <= t < self.num_rows:
            raise IndexError(f"row {t} out of range for {self.num_rows} rows")
        t %= self.num_rows
        return self.ids[self.offsets[t] : self.offsets[t + 1]]

    def to_lists(self) -> list[list[int]]:
        return [r.tolist() for r in np.split(self.ids, self.offsets[1:-1])] if self.num_rows else []

    def __repr__(self) -> str:
        return f"SupportTable(rows={self.num_rows}, nnz={self.nnz})"

    def __eq__(self, other) -> bool:
        if not isinstance(other, SupportTable):
            return NotImplemented
        return np.array_equal(self.offsets, other.offsets) and np.array_equal(self.ids, other.ids)

    __hash__ = None  # mutable arrays inside

    # ---- operations ---------------------------------------------------------------

    @staticmethod
    def concat(tables: Sequence[SupportTable]) -> SupportTable:
        """Rows of ``tables[0]``, then of ``tables[1]``, ..."""
        tables = list(tables)
        if not tables:
            return SupportTable.empty()
        ids = np.concatenate([t.ids for t in tables])
        sizes = np.concatenate([t.sizes() for t in tables])
        offsets = offsets_from_sizes(sizes)
        return SupportTable(ids, offsets)

    def __add__(self, other: SupportTable) -> SupportTable:
        return SupportTable.concat([self, other])

    def prefix(self, n: int) -> SupportTable:
        """The first ``n`` rows (a truncated response keeps the support of what it kept)."""
        if not 0 <= n <= self.num_rows:
            raise SupportError(f"prefix: n={n} outside [0, {self.num_rows}]")
        end = self.offsets[n]
        return SupportTable(self.ids[:end].copy(), self.offsets[: n + 1].copy())

    def select(self, rows) -> SupportTable:
        """Rows in the given order (context-parallel slicing, reordering)."""
        rows = _as_int_array(rows, "rows", np.int64)
        if len(rows) and (rows.min() < -self.num_rows or rows.max() >= self.num_rows):
            bad = int(rows[(rows < -self.num_rows) | (rows >= self.num_rows)][0])
            raise SupportError(f"select: row {bad} out of range for {self.num_rows} rows")
        rows = rows % max(self.num_rows, 1)
        sizes = self.sizes()[rows]
        offsets = offsets_from_sizes(sizes)
        # position of every output id in the source: start of its source row + rank in row
        starts = np.repeat(self.offsets[rows], sizes)
        within = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], sizes)
        return SupportTable(self.ids[starts + within], offsets)

    def to_padded(self, k: int | None = None, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(ids[T, K] int64, valid[T, K] bool)``; padding repeats the row's first id.

        Padding with a real id of the row keeps every gather in range; ``valid`` says
        which entries belong to the support.
        """
        width = self.max_size() if k is None else int(k)
        if k is not None and width < self.max_size():
            raise SupportError(f"to_padded: K={width} is smaller than the largest support ({self.max_size()})")
        rows = self.num_rows
        src, valid = self._padded_index(width)
        ids = self.ids[src] if self.nnz else np.zeros((rows, width), np.int32)
        ids_t = torch.from_numpy(ids.astype(np.int64, copy=False).reshape(rows, width))
        valid_t = torch.from_numpy(valid.reshape(rows, width))
        if device is not None:
            ids_t, valid_t = ids_t.to(device), valid_t.to(device)
        return ids_t, valid_t

    def _padded_index(self, width: int) -> tuple[np.ndarray, np.ndarray]:
        """``(src[T, K], valid[T, K])``: the flat position of every padded entry (a row's first at padding)."""
        cols = np.arange(width, dtype=np.int64)
        valid = cols[None, :] < self.sizes()[:, None]
        return self.offsets[:-1, None] + np.where(valid, cols[None, :], 0), valid

    def padded_values(self, values: np.ndarray, device=None) -> torch.Tensor:
        """Per-id ``values`` (aligned with ``ids``) laid out like ``to_padded()``: ``[T, K]`` float32, 0 at padding."""
        if len(values) != self.nnz:
            raise SupportError(f"padded_values: {len(values)} values for {self.nnz} support ids")
        src, valid = self._padded_index(self.max_size())
        out = np.where(valid, np.asarray(values, np.float32)[src], 0.0) if self.nnz else np.zeros(src.shape, np.float32)
        out = torch.from_numpy(out.astype(np.float32, copy=False))
        return out if device is None else out.to(device)

    def contains(self, tokens) -> np.ndarray:
        """``out[t]`` is True when ``tokens[t]`` lies in row t (rows must be canonical)."""
        tokens = _as_int_array(tokens, "tokens", np.int64)
        if len(tokens) != self.num_rows:
            raise SupportError(f"contains: {len(tokens)} tokens for {self.num_rows} rows")
        _, found = self.locate(tokens)
        return found & (tokens >= 0)

    def locate(self, tokens: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Where ``tokens[t]`` stands in the flat ``ids`` if it is in row t, or where it would be
        inserted to keep the row sorted, and whether it is there (one row per token, rows canonical):
        a single ``searchsorted`` over ``row << 32 | id`` keys, which sort like (row, id)."""
        keys = (_row_index(self.offsets) << 32) | self.ids.astype(np.int64)
        queries = (np.arange(self.num_rows, dtype=np.int64) << 32) | (tokens.astype(np.int64) & 0xFFFFFFFF)
        pos = np.searchsorted(keys, queries)
        found = pos < len(keys)
        found[found] = keys[pos[found]] == queries[found]
        return pos, found

    # ---- validation ---------------------------------------------------------------

    def _check_structure(self) -> None:
        off = self.offsets
        if off[0] != 0:
            raise SupportError(f"offsets: must start at 0, got {int(off[0])}")
        steps = np.diff(off)
        if len(steps) and steps.min() <= 0:
            t = int(np.flatnonzero(steps <= 0)[0])
            rule = "empty support" if steps[t] == 0 else "offsets decrease"
            raise SupportError(f"row {t}: {rule} (offsets[{t}]={int(off[t])}, offsets[{t + 1}]={int(off[t + 1])})")
        if off[-1] != len(self.ids):
            raise SupportError(f"offsets: last offset {int(off[-1])} != number of ids {len(self.ids)}")

    def _sorted_rows(self) -> SupportTable:
        if self.nnz < 2:
            return self
        rows = _row_index(self.offsets)
        same_row = rows[1:] == rows[:-1]
        if np.all(self.ids[1:][same_row] >= self.ids[:-1][same_row]):
            return self
        order = np.lexsort((self.ids, rows))
        return SupportTable(self.ids[order], self.offsets)

    def validate(self, vocab_size: int, selected=None, *, name: str = "support") -> SupportTable:
        """Check every invariant; raise ``SupportError`` naming the row, the id and the rule.

        Rules: offsets start at 0, strictly increase (no empty support) and end at
        ``len(ids)``; ids in ``[0, vocab_size)``; ids of a row ascending without
        duplicates; ``selected[t]`` (when given) inside row t. Returns ``self``.
        """
        self._check_structure()
        if self.nnz:
            bad = (self.ids < 0) | (self.ids >= vocab_size)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                t = int(_row_index(self.offsets)[i])
                raise SupportError(f"{name} row {t}: id {int(self.ids[i])} outside the vocabulary [0, {vocab_size})")
            rows = _row_index(self.offsets)
            same_row = rows[1:] == rows[:-1]
            step = self.ids[1:].astype(np.int64) - self.ids[:-1]
            broken = same_row & (step <= 0)
            if broken.any():
                i = int(np.flatnonzero(broken)[0])
                t, a, b = int(rows[i]), int(self.ids[i]), int(self.ids[i + 1])
                rule = f"duplicate id {a}" if a == b else f"ids not ascending ({a} before {b})"
                raise SupportError(f"{name} row {t}: {rule}")
        if selected is not None:
            selected = _as_int_array(selected, "selected", np.int64)
            if len(selected) != self.num_rows:
                raise SupportError(f"{name}: {self.num_rows} support rows for {len(selected)} selected tokens")
            inside = self.contains(selected)
            if not inside.all():
                t = int(np.flatnonzero(~inside)[0])
                raise SupportError(f"{name} row {t}: selected token {int(selected[t])} is not in its support")
        return self
