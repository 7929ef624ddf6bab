"""Compact, versioned transport of a SupportTable (docs/wire-format.md).

Layout (little-endian header, then three byte streams)::

    magic "SRPW" | version u8 | flags u8 | rows u32 | vocab u32
    | len(counts) u32 | len(high) u32 | len(low) u32
    | counts: LEB128 varint per row, n_t = |S_t| (or |S_t| - 1 with SELECTED_RELATIVE)
    | high:   unary quotients of the id gaps, bit-packed MSB first
    | low:    Rice remainders of the id gaps, grouped by width, bit-packed

Ids of a row are sorted; gaps ``g_0 = e_0``, ``g_i = e_i - e_{i-1} - 1`` are Rice-coded
with a per-row parameter ``b_t`` derived from ``n_t`` and the vocabulary size, so the
decoder needs no side information. With ``selected`` tokens (flag SELECTED_RELATIVE)
the selected id is left out of its row, so a singleton costs one byte.

Decoding is strict: every length is checked against the bytes actually present before
anything is allocated, and any inconsistency raises ``WireError``. Decoded rows are
canonical by construction (ascending, in the vocabulary). Engine payloads (SGLang's
``meta_info``, vLLM's responses) are parsed by the backend that speaks that engine.
"""

from __future__ import annotations

import base64
import binascii
import struct

import numpy as np

from ..errors import SupportError, WireError
from .support import SupportTable, _as_int_array, _row_index, offsets_from_sizes

MAGIC = b"SRPW"
VERSION = 1
FLAG_SELECTED_RELATIVE = 0x01
_HEADER = struct.Struct("<4sBBIIIII")
_MAX_VARINT_BYTES = 5  # counts are < 2**35
_MAX_VOCAB = 2**31 - 1
MAX_STREAM_BYTES = 1 << 24  # decoding takes at most ~180x its input in memory (docs/reliability.md)


# ---- varint (LEB128) ---------------------------------------------------------------


def _varint_encode(values: np.ndarray) -> bytes:
    values = values.astype(np.uint64)
    if not len(values):
        return b""
    nbytes = np.maximum(1, (_bit_length(values) + 6) // 7)
    width = int(nbytes.max())
    shifts = (7 * np.arange(width, dtype=np.uint64))[None, :]
    groups = ((values[:, None] >> shifts) & np.uint64(0x7F)).astype(np.uint8)
    col = np.arange(width)[None, :]
    groups |= np.where(col < nbytes[:, None] - 1, 0x80, 0).astype(np.uint8)
    return groups[col < nbytes[:, None]].tobytes()


def _varint_decode(data: np.ndarray, count: int, what: str) -> np.ndarray:
    ends = np.flatnonzero(data < 0x80)
    if len(ends) != count or (count and ends[-1] != len(data) - 1) or (not count and len(data)):
        raise WireError(f"{what}: expected {count} varints in {len(data)} bytes, found {len(ends)} terminators")
    if not count:
        return np.zeros(0, np.int64)
    starts = np.concatenate(([0], ends[:-1] + 1)).astype(np.int64)
    lengths = ends - starts + 1
    if lengths.max() > _MAX_VARINT_BYTES:
        raise WireError(f"{what}: varint of {int(lengths.max())} bytes exceeds {_MAX_VARINT_BYTES}")
    pos_in_value = np.arange(len(data), dtype=np.int64) - np.repeat(starts, lengths)
    contrib = (data & 0x7F).astype(np.int64) << (7 * pos_in_value)
    return np.add.reduceat(contrib, starts)


def _bit_length(values: np.ndarray) -> np.ndarray:
    """floor(log2(v)) + 1 for v >= 1, 0 for v == 0 (exact for v < 2**53)."""
    _, exp = np.frexp(values.astype(np.float64))
    return np.where(values > 0, exp, 0).astype(np.int64)


def _rice_widths(counts: np.ndarray, vocab: int) -> np.ndarray:
    """Rice parameter per row: about log2(0.69 * mean gap), the optimum for geometric gaps."""
    target = (np.int64(vocab) * 11) // (16 * (counts.astype(np.int64) + 1))
    return np.maximum(_bit_length(target) - 1, 0)


# ---- bit packing -------------------------------------------------------------------


def _pack_fixed(values: np.ndarray, width: int) -> bytes:
    if width == 0 or not len(values):
        return b""
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)[None, :]
    bits = ((values[:, None] >> shifts) & 1).astype(np.uint8)
    return np.packbits(bits.reshape(-1)).tobytes()


def _unpack_fixed(data: np.ndarray, count: int, width: int) -> np.ndarray:
    if width == 0 or not count:
        return np.zeros(count, np.int64)
    bits = np.unpackbits(data)[: count * width].reshape(count, width).astype(np.int64)
    shifts = np.arange(width - 1, -1, -1, dtype=np.int64)[None, :]
    return (bits << shifts).sum(axis=1)


def _low_layout(widths: np.ndarray):
    """Groups of equal Rice width, in ascending width: ``(width, element indices)``."""
    order = np.argsort(widths, kind="stable")
    sorted_w = widths[order]
    cuts = np.flatnonzero(np.diff(sorted_w)) + 1
    for idx in np.split(order, cuts) if len(order) else []:
        yield int(widths[idx[0]]), idx


# ---- encode / decode -----------------------------------------------------------------


def _drop_selected(table: SupportTable, selected: np.ndarray) -> SupportTable:
    """``table`` without each row's selected token (``encode`` validated that it is there)."""
    where, _ = table.locate(selected)
    offsets = table.offsets - np.arange(table.num_rows + 1, dtype=np.int64)
    return SupportTable(np.delete(table.ids, where), offsets)


def encode(table: SupportTable, vocab_size: int, selected=None) -> bytes:
    """Encode ``table`` (validated against ``vocab_size``); pass ``selected`` to drop a_t from its row."""
    if not 0 < vocab_size <= _MAX_VOCAB:
        raise WireError(f"vocab_size: must be in [1, {_MAX_VOCAB}], got {vocab_size}")
    try:
        table.validate(vocab_size, selected)
    except SupportError as exc:
        raise WireError(f"cannot encode an invalid support: {exc}") from exc
    flags = 0
    if selected is not None:
        table = _drop_selected(table, _as_int_array(selected, "selected", np.int64))
        flags |= FLAG_SELECTED_RELATIVE
    counts = table.sizes()
    widths_row = _rice_widths(counts, vocab_size)
    ids = table.ids.astype(np.int64)
    prev = np.concatenate(([-1], ids[:-1]))[: len(ids)]
    prev[table.offsets[:-1][counts > 0]] = -1  # the first gap of a row starts from -1
    gaps = ids - prev - 1
    widths = np.repeat(widths_row, counts)
    quotients = gaps >> widths
    high_bits = np.zeros(int(quotients.sum() + len(gaps)), dtype=np.uint8)
    high_bits[np.cumsum(quotients + 1) - 1] = 1
    high = np.packbits(high_bits).tobytes()
    remainders = gaps & ((np.int64(1) << widths) - 1)
    low = b"".join(_pack_fixed(remainders[idx], w) for w, idx in _low_layout(widths))
    counts_bytes = _varint_encode(counts)
    header = _HEADER.pack(MAGIC, VERSION, flags, table.num_rows, vocab_size, len(counts_bytes), len(high), len(low))
    return header + counts_bytes + high + low


def decode(data: bytes, selected=None, vocab_size: int | None = None) -> SupportTable:
    """Decode bytes from ``encode``. ``selected`` is required when the stream was encoded with it."""
    if len(data) > MAX_STREAM_BYTES:
        raise WireError(f"stream of {len(data)} bytes exceeds the {MAX_STREAM_BYTES}-byte limit")
    buf = np.frombuffer(bytes(data), dtype=np.uint8) if not isinstance(data, np.ndarray) else data
    relative, rows, vocab, n_counts, n_high, n_low = _read_header(buf, vocab_size)
    sel = _selected_tokens(selected, rows, vocab) if relative else None
    start = _HEADER.size
    counts = _varint_decode(buf[start : start + n_counts], rows, "counts")
    if not relative and rows and counts.min() == 0:
        raise WireError(f"row {int(np.argmin(counts))}: empty support")
    total = int(counts.sum())
    if total > 8 * n_high:
        raise WireError(f"{total} ids announced but the gap stream holds at most {8 * n_high}")
    if total > vocab * max(rows, 1):
        raise WireError(f"{total} ids cannot fit in {rows} rows of a {vocab}-token vocabulary")
    gaps = _read_gaps(buf[start + n_counts :], counts, vocab, n_high, n_low)
    offsets = offsets_from_sizes(counts)
    steps = gaps + 1
    running = np.cumsum(steps)
    row_base = np.repeat(np.concatenate(([0], running))[offsets[:-1]], counts)
    ids = running - row_base - 1
    if total and ids.max() >= vocab:
        i = int(np.argmax(ids >= vocab))
        raise WireError(f"row {int(_row_index(offsets)[i])}: id {int(ids[i])} outside the vocabulary [0, {vocab})")
    table = SupportTable(ids.astype(np.int32), offsets)
    if relative:
        table = _insert_selected(table, sel)
    return table


def _read_header(buf: np.ndarray, vocab_size: int | None) -> tuple[bool, int, int, int, int, int]:
    """``(relative, rows, vocab, count bytes, gap bytes, remainder bytes)``, every field checked against the
    stream's length and the expected vocabulary."""
    if len(buf) < _HEADER.size:
        raise WireError(f"truncated: {len(buf)} bytes is shorter than the {_HEADER.size}-byte header")
    magic, version, flags, rows, vocab, n_counts, n_high, n_low = _HEADER.unpack(buf[: _HEADER.size].tobytes())
    if magic != MAGIC:
        raise WireError(f"wrong magic {magic!r}, expected {MAGIC!r}: not a support-replay wire stream")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version} (this build reads version {VERSION})")
    if flags & ~FLAG_SELECTED_RELATIVE:
        raise WireError(f"unknown flags 0x{flags:02x}")
    if not 0 < vocab <= _MAX_VOCAB:
        raise WireError(f"vocab size {vocab} in the header is invalid")
    if vocab_size is not None and vocab != vocab_size:
        raise WireError(f"vocab size {vocab} in the stream differs from the expected {vocab_size}")
    expected = _HEADER.size + n_counts + n_high + n_low
    if len(buf) != expected:
        kind = "truncated" if len(buf) < expected else "trailing bytes"
        raise WireError(f"{kind}: header announces {expected} bytes, got {len(buf)}")
    if rows > n_counts:
        raise WireError(f"{rows} rows cannot fit in {n_counts} count bytes")
    return bool(flags & FLAG_SELECTED_RELATIVE), rows, vocab, n_counts, n_high, n_low


def _selected_tokens(selected, rows: int, vocab: int) -> np.ndarray:
    """The sampled tokens a relative stream was encoded against: one per row, each inside the vocabulary."""
    if selected is None:
        raise WireError("stream was encoded relative to the selected tokens; pass selected= to decode it")
    sel = _as_int_array(selected, "selected", np.int64)
    if len(sel) != rows:
        raise WireError(f"selected: {len(sel)} tokens for {rows} rows in the stream")
    if len(sel) and (sel.min() < 0 or sel.max() >= vocab):
        raise WireError(f"selected token {int(sel[(sel < 0) | (sel >= vocab)][0])} outside [0, {vocab})")
    return sel


def _read_gaps(buf: np.ndarray, counts: np.ndarray, vocab: int, n_high: int, n_low: int) -> np.ndarray:
    """The gaps between a row's ids, from their unary quotients (``n_high`` bytes) and fixed-width remainders
    (``n_low`` bytes, one width per row)."""
    total = int(counts.sum())
    high = np.unpackbits(buf[:n_high])
    ones = np.flatnonzero(high)
    if len(ones) != total or (total and len(high) - ones[-1] - 1 >= 8) or (not total and n_high):
        raise WireError(f"gap stream: expected {total} terminators, found {len(ones)} in {n_high} bytes")
    quotients = np.diff(np.concatenate(([-1], ones))) - 1
    widths = np.repeat(_rice_widths(counts, vocab), counts)
    if total and np.any(quotients > (vocab >> widths)):
        raise WireError(f"gap stream: a gap exceeds the vocabulary size {vocab}")
    layout = list(_low_layout(widths))
    low_bytes = sum((len(idx) * w + 7) // 8 for w, idx in layout)
    if low_bytes != n_low:
        raise WireError(f"remainder stream: expected {low_bytes} bytes, header says {n_low}")
    remainders = np.zeros(total, np.int64)
    pos = n_high
    for w, idx in layout:
        size = (len(idx) * w + 7) // 8
        remainders[idx] = _unpack_fixed(buf[pos : pos + size], len(idx), w)
        pos += size
    return (quotients << widths) | remainders


def _insert_selected(table: SupportTable, selected: np.ndarray) -> SupportTable:
    if table.nnz:
        where, hit = table.locate(selected)
        if hit.any():
            t = int(np.flatnonzero(hit)[0])
            raise WireError(f"row {t}: selected token {int(selected[t])} is stored twice")
        ids = np.insert(table.ids, where, selected.astype(np.int32))
    else:
        ids = selected.astype(np.int32)
    offsets = table.offsets + np.arange(table.num_rows + 1, dtype=np.int64)
    return SupportTable(ids, offsets)


def to_json(table: SupportTable, vocab_size: int, selected=None) -> str:
    """The binary encoding as base64 text, for JSON payloads."""
    return base64.b64encode(encode(table, vocab_size, selected)).decode("ascii")


def from_json(text: str, selected=None, vocab_size: int | None = None) -> SupportTable:
    if not isinstance(text, str):
        raise WireError(f"expected a base64 string, got {type(text).__name__}")
    try:
        raw = base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError) as exc:
        raise WireError(f"not valid base64: {exc}") from exc
    return decode(raw, selected, vocab_size)


# ---- per-id values (the sampler's log q of every support id) -------------------------


def floats_to_json(rows) -> str:
    """Base64 of the rows' values as float32 little-endian, concatenated (4 bytes per support id, exact
    for the engine's fp32 log-probs); the reader splits them by the support's row sizes."""
    flat = np.concatenate([np.asarray(r, dtype="<f4") for r in rows]) if len(rows) else np.zeros(0, "<f4")
    return base64.b64encode(flat.astype("<f4").tobytes()).decode("ascii")


def floats_from_json(text, sizes: np.ndarray, where: str) -> list[np.ndarray]:
    """``floats_to_json`` back into one float32 array per row of ``sizes`` ids."""
    if not isinstance(text, str) or len(text) > MAX_STREAM_BYTES * 4 // 3 + 4:
        raise WireError(f"{where}: expected a base64 string of float32 values")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise WireError(f"{where}: not base64: {exc}") from None
    total = int(np.sum(sizes))
    if len(raw) != 4 * total:
        raise WireError(f"{where}: {len(raw)} bytes for {total} support ids (4 bytes each)")
    flat = np.frombuffer(raw, dtype="<f4").astype(np.float32)
    return np.split(flat, np.cumsum(sizes)[:-1]) if len(sizes) else []
