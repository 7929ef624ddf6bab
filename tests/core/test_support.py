import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from support_replay import SupportError, SupportTable

VOCAB = 50

rows_strategy = st.lists(st.sets(st.integers(0, VOCAB - 1), min_size=1, max_size=12).map(list), max_size=20)


def shuffled(rows, seed=0):
    rng = np.random.default_rng(seed)
    return [list(rng.permutation(r)) for r in rows]


@given(rows_strategy)
def test_from_lists_is_canonical_and_valid(rows):
    table = SupportTable.from_lists(shuffled(rows))
    assert table.ids.dtype == np.int32 and table.offsets.dtype == np.int64
    assert len(table.offsets) == len(rows) + 1
    assert table.to_lists() == [sorted(r) for r in rows]
    assert table.sizes().tolist() == [len(r) for r in rows]
    table.validate(VOCAB)


@given(rows_strategy)
def test_padded_round_trip(rows):
    table = SupportTable.from_lists(rows)
    ids, valid = table.to_padded()
    assert ids.dtype == torch.int64 and valid.dtype == torch.bool
    back = SupportTable.from_padded(ids, valid.sum(-1))
    assert back == table
    if rows:
        wide_ids, wide_valid = table.to_padded(k=table.max_size() + 3)
        assert SupportTable.from_padded(wide_ids, wide_valid.sum(-1)) == table
        # padding repeats a real id of the row, so gathers stay in range
        for t, r in enumerate(rows):
            assert set(wide_ids[t].tolist()) <= set(r)


@given(rows_strategy, rows_strategy)
def test_concat_prefix_select(a_rows, b_rows):
    a, b = SupportTable.from_lists(a_rows), SupportTable.from_lists(b_rows)
    both = SupportTable.concat([a, b])
    assert both.to_lists() == a.to_lists() + b.to_lists()
    assert both.prefix(len(a_rows)) == a
    assert both.select(np.arange(len(a_rows), len(a_rows) + len(b_rows))) == b
    order = np.random.default_rng(1).permutation(both.num_rows)
    assert both.select(order).to_lists() == [both.to_lists()[i] for i in order]
    both.validate(VOCAB)


@given(rows_strategy, st.data())
def test_contains_matches_python(rows, data):
    table = SupportTable.from_lists(rows)
    tokens = [data.draw(st.integers(0, VOCAB - 1)) for _ in rows]
    assert table.contains(tokens).tolist() == [tok in r for tok, r in zip(tokens, rows)]


def test_singleton_and_mask():
    t = SupportTable.singleton([4, 2, 9])
    assert t.to_lists() == [[4], [2], [9]]
    t.validate(10, selected=[4, 2, 9])
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, [5, 1]] = True
    mask[1, 3] = True
    assert SupportTable.from_mask(mask).to_lists() == [[1, 5], [3]]


def test_equality_and_empty():
    assert SupportTable.from_lists([[1, 2]]) == SupportTable.from_lists([[2, 1]])
    assert SupportTable.from_lists([[1, 2]]) != SupportTable.from_lists([[1], [2]])
    assert SupportTable.empty().num_rows == 0
    assert SupportTable.concat([]) == SupportTable.empty()


# ---- one test per rule -----------------------------------------------------------


def test_offsets_must_start_at_zero():
    with pytest.raises(SupportError, match="must start at 0, got 1"):
        SupportTable([1, 2], [1, 2]).validate(10)


def test_empty_support_names_the_row():
    with pytest.raises(SupportError, match="row 1: empty support"):
        SupportTable([1, 2], [0, 1, 1, 2]).validate(10)


def test_decreasing_offsets():
    with pytest.raises(SupportError, match="row 1: offsets decrease"):
        SupportTable([1, 2, 3], [0, 2, 1, 3]).validate(10)


def test_last_offset_must_match_ids():
    with pytest.raises(SupportError, match="last offset 2 != number of ids 3"):
        SupportTable([1, 2, 3], [0, 1, 2]).validate(10)


def test_id_out_of_vocabulary():
    with pytest.raises(SupportError, match=r"row 1: id 10 outside the vocabulary \[0, 10\)"):
        SupportTable.from_lists([[1], [3, 10]]).validate(10)


def test_negative_id_rejected_at_construction():
    with pytest.raises(SupportError, match="row 1: id -3"):
        SupportTable.from_lists([[1], [-3]])


def test_duplicate_id():
    with pytest.raises(SupportError, match="row 0: duplicate id 4"):
        SupportTable.from_lists([[4, 1, 4]]).validate(10)


def test_unsorted_raw_row():
    with pytest.raises(SupportError, match=r"row 0: ids not ascending \(5 before 2\)"):
        SupportTable([5, 2], [0, 2]).validate(10)


def test_selected_outside_support():
    with pytest.raises(SupportError, match="row 1: selected token 7 is not in its support"):
        SupportTable.from_lists([[1], [2, 3]]).validate(10, selected=[1, 7])


def test_selected_count_mismatch():
    with pytest.raises(SupportError, match="2 support rows for 3 selected"):
        SupportTable.from_lists([[1], [2]]).validate(10, selected=[1, 2, 2])


def test_bad_padded_inputs():
    with pytest.raises(SupportError, match="row 0: length 3 outside"):
        SupportTable.from_padded(np.zeros((1, 2), np.int64), [3])
    with pytest.raises(SupportError, match="does not match"):
        SupportTable.from_padded(np.zeros((2, 2), np.int64), [1])


def test_operation_errors():
    t = SupportTable.from_lists([[1], [2]])
    with pytest.raises(SupportError, match="prefix: n=3"):
        t.prefix(3)
    with pytest.raises(SupportError, match="select: row 5 out of range"):
        t.select([5])
    with pytest.raises(SupportError, match="K=0 is smaller"):
        t.to_padded(k=0)
    with pytest.raises(SupportError, match="expected integers"):
        SupportTable([1.5], [0, 1])


@settings(max_examples=50)
@given(rows_strategy)
def test_from_csr_sorts_rows(rows):
    rows = shuffled(rows, seed=3)
    flat = [i for r in rows for i in r]
    offsets = np.cumsum([0] + [len(r) for r in rows])
    assert SupportTable.from_csr(np.array(flat, np.int32), offsets).to_lists() == [sorted(r) for r in rows]


def test_offsets_from_sizes_and_locate_against_a_loop():
    from support_replay.core.support import offsets_from_sizes

    rng = np.random.default_rng(3)
    rows = [np.sort(rng.choice(50, size=int(k), replace=False)) for k in rng.integers(0, 6, size=40)]
    table = SupportTable.from_rows(rows)
    assert offsets_from_sizes([len(r) for r in rows]).tolist() == table.offsets.tolist()
    assert offsets_from_sizes([]).tolist() == [0]
    tokens = rng.integers(0, 50, size=len(rows))
    pos, found = table.locate(tokens)
    for t, (row, token) in enumerate(zip(rows, tokens)):
        assert found[t] == (token in row)
        assert pos[t] == table.offsets[t] + np.searchsorted(row, token)  # where it is, or would be inserted


def test_per_id_values_are_laid_out_like_the_padded_ids():
    table = SupportTable.from_lists([[3, 7, 9], [2], [4, 5]])
    values = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], np.float32)
    ids, valid = table.to_padded()
    padded = table.padded_values(values)
    assert padded.shape == ids.shape and (padded[~valid] == 0).all()
    assert padded[valid].tolist() == pytest.approx(values.tolist())
    with pytest.raises(SupportError, match="padded_values: 5 values for 6 support ids"):
        table.padded_values(values[:5])
