import struct

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support_replay import SupportTable, WireError, wire

vocab_strategy = st.sampled_from([1, 2, 7, 1000, 151936, 2**31 - 1])


@st.composite
def tables(draw):
    vocab = draw(vocab_strategy)
    n_rows = draw(st.integers(0, 25))
    rows = [
        sorted(draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=min(vocab, 40)))) for _ in range(n_rows)
    ]
    selected = [draw(st.sampled_from(r)) for r in rows]
    return SupportTable.from_lists(rows), selected, vocab


@given(tables())
def test_round_trip(case):
    table, selected, vocab = case
    assert wire.decode(wire.encode(table, vocab)) == table
    assert wire.decode(wire.encode(table, vocab, selected), selected) == table
    assert wire.from_json(wire.to_json(table, vocab, selected), selected, vocab_size=vocab) == table


def test_singletons_equal_to_selected_cost_one_byte_each():
    tokens = np.arange(1000) * 7
    table = SupportTable.singleton(tokens)
    blob = wire.encode(table, 151936, tokens)
    assert len(blob) <= wire._HEADER.size + 1000 + 1
    assert wire.decode(blob, tokens) == table


def test_dense_rows_and_edges():
    table = SupportTable.from_lists([list(range(1000)), [0], [999], [0, 999]])
    assert wire.decode(wire.encode(table, 1000)) == table
    assert wire.decode(wire.encode(SupportTable.empty(), 5)) == SupportTable.empty()


def _blob():
    table = SupportTable.from_lists([[1, 5, 9], [2], [3, 4]])
    return table, wire.encode(table, 10)


def test_truncated():
    _, blob = _blob()
    for cut in (0, 5, len(blob) - 1):
        with pytest.raises(WireError, match="truncated"):
            wire.decode(blob[:cut])


def test_trailing_bytes():
    _, blob = _blob()
    with pytest.raises(WireError, match="trailing bytes"):
        wire.decode(blob + b"\0")


def test_wrong_magic():
    _, blob = _blob()
    with pytest.raises(WireError, match="wrong magic"):
        wire.decode(b"XXXX" + blob[4:])


def test_wrong_version():
    _, blob = _blob()
    with pytest.raises(WireError, match="unsupported wire version 9"):
        wire.decode(blob[:4] + bytes([9]) + blob[5:])


def test_unknown_flags():
    _, blob = _blob()
    with pytest.raises(WireError, match="unknown flags"):
        wire.decode(blob[:5] + bytes([0x80]) + blob[6:])


def test_vocab_mismatch_and_ids_out_of_range():
    table, blob = _blob()
    with pytest.raises(WireError, match="differs from the expected 12"):
        wire.decode(blob, vocab_size=12)
    header = list(struct.unpack("<4sBBIIIII", blob[:26]))
    header[4] = 6  # shrink the vocabulary below id 9
    forged = struct.pack("<4sBBIIIII", *header) + blob[26:]
    with pytest.raises(WireError, match=r"row 0: id 9 outside the vocabulary \[0, 6\)"):
        wire.decode(forged)


def test_counts_do_not_add_up():
    _, blob = _blob()
    header = list(struct.unpack("<4sBBIIIII", blob[:26]))
    header[3] = 2  # claim fewer rows than the counts stream holds
    with pytest.raises(WireError, match="expected 2 varints"):
        wire.decode(struct.pack("<4sBBIIIII", *header) + blob[26:])
    header[3] = 2**32 - 1  # a huge row count must not allocate
    with pytest.raises(WireError, match="cannot fit"):
        wire.decode(struct.pack("<4sBBIIIII", *header) + blob[26:])


def test_empty_row_in_stream():
    header = struct.pack("<4sBBIIIII", b"SRPW", 1, 0, 1, 10, 1, 0, 0)
    with pytest.raises(WireError, match="row 0: empty support"):
        wire.decode(header + b"\x00")


def test_relative_stream_needs_selected():
    table, _ = _blob()
    blob = wire.encode(table, 10, [5, 2, 4])
    with pytest.raises(WireError, match="pass selected="):
        wire.decode(blob)
    with pytest.raises(WireError, match="selected: 2 tokens for 3 rows"):
        wire.decode(blob, [5, 2])
    with pytest.raises(WireError, match="stored twice"):
        wire.decode(blob, [5, 2, 3])
    with pytest.raises(WireError, match="outside"):
        wire.decode(blob, [5, 2, 11])


def test_encode_rejects_invalid_tables():
    with pytest.raises(WireError, match="selected token 3 is not in its support"):
        wire.encode(SupportTable.from_lists([[1, 2]]), 10, [3])
    with pytest.raises(WireError, match="outside the vocabulary"):
        wire.encode(SupportTable.from_lists([[11]]), 10)
    with pytest.raises(WireError, match="vocab_size"):
        wire.encode(SupportTable.from_lists([[1]]), 0)


def test_json_form_rejects_bad_text():
    with pytest.raises(WireError, match="not valid base64"):
        wire.from_json("@@@")
    with pytest.raises(WireError, match="expected a base64 string"):
        wire.from_json(123)


@settings(max_examples=400)
@given(st.binary(max_size=200))
def test_fuzzed_bytes_never_crash(data):
    try:
        table = wire.decode(data)
    except WireError:
        return
    table.validate(2**31 - 1)


@settings(max_examples=300)
@given(st.data())
def test_mutated_streams_never_crash(data):
    table, blob = _blob()
    raw = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    try:
        decoded = wire.decode(bytes(raw))
    except WireError:
        return
    decoded.validate(2**31 - 1)
