"""The routing codecs (SGLang's raw int32, vLLM's .npy) and the fail-closed checks of a routing array."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support_replay.core.routing import (
    RoutingShape,
    compact_dtype,
    decode_int32,
    decode_npy,
    encode_int32,
    encode_npy,
    routing_agreement,
    routing_problem,
)
from support_replay.errors import WireError

SHAPE = RoutingShape(layers=3, top_k=2, num_experts=8, moe_layers=(0, 1, 2))


def routing(positions: int, shape: RoutingShape = SHAPE, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    rows = [rng.permutation(shape.num_experts)[: shape.top_k] for _ in range(positions * shape.layers)]
    return np.asarray(rows, np.int32).reshape(positions, shape.layers, shape.top_k)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.sampled_from([8, 128, 256, 257, 4096, 70000]), st.integers(0, 10**6))
def test_both_forms_round_trip(positions, experts, seed):
    shape = RoutingShape(layers=2, top_k=4, num_experts=experts, moe_layers=(0, 1))
    routed = routing(positions, shape, seed)
    assert np.array_equal(decode_npy(encode_npy(routed, experts), "r"), routed)
    assert np.array_equal(decode_int32(encode_int32(routed), 2, 4, "r"), routed)


def test_the_compact_form_takes_the_fewest_bytes_the_expert_count_allows():
    assert [compact_dtype(n).itemsize for n in (8, 256, 257, 65536, 65537)] == [1, 1, 2, 2, 4]
    raw = base64.b64decode(encode_npy(routing(100), 8))
    assert np.load(io.BytesIO(raw)).dtype == np.uint8  # vLLM's dtype for <= 256 experts
    assert SHAPE.bytes_per_token() == 6 and SHAPE.bytes_per_token(np.int32) == 24


def test_sglang_bytes_are_the_raw_int32_of_the_array():
    routed = routing(5)
    assert base64.b64decode(encode_int32(routed)) == routed.astype("<i4").tobytes()


@pytest.mark.parametrize(
    "value, match",
    [
        (17, "base64 string"),
        ("not base64!", "not base64"),
        (base64.b64encode(b"\x93NUMPY garbage").decode(), "not a .npy"),
        (encode_npy(np.zeros((3, 2), np.int32), 8), "integer \\[positions, layers, top_k\\]"),
    ],
)
def test_npy_payloads_fail_closed(value, match):
    with pytest.raises(WireError, match=match):
        decode_npy(value, "completion 0")


def test_a_pickled_npy_is_refused():
    buffer = io.BytesIO()
    np.save(buffer, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(WireError, match="not a .npy"):
        decode_npy(base64.b64encode(buffer.getvalue()).decode(), "completion 0")


def test_int32_payloads_must_be_whole_positions():
    with pytest.raises(WireError, match="not a whole number of positions of 3 layers x 2 experts"):
        decode_int32(base64.b64encode(b"\0" * 20).decode(), 3, 2, "completion 0")


def test_routing_problems_name_the_position_and_layer():
    good = routing(6)
    assert routing_problem(good, 6, SHAPE) is None
    assert "for 6 positions, expected 7" in routing_problem(good, 7, SHAPE)
    assert "for 3 layers, the model has 4" in routing_problem(good, 6, RoutingShape(4, 2, 8, (0, 1, 2, 3)))
    assert "top-2, the model routes each token to 3" in routing_problem(good, 6, RoutingShape(3, 3, 8, (0, 1, 2)))
    bad = good.copy()
    bad[4, 2, 1] = 8
    assert routing_problem(bad, 6, SHAPE) == "position 4 layer 2: expert id 8 outside [0, 8)"
    bad = good.copy()
    bad[2, 1] = [5, 5]
    assert "position 2 layer 1: expert ids [5, 5] repeat an expert" == routing_problem(bad, 6, SHAPE)
    dense_layer = RoutingShape(3, 2, 8, (0, 2))  # a layer without experts is never read
    junk = good.copy()
    junk[:, 1] = -7
    assert routing_problem(junk, 6, dense_layer) is None


def test_agreement_counts_equal_sets_where_the_capture_has_a_choice():
    own = routing(4)
    captured = own[..., ::-1].copy()  # the same sets in another order
    captured[1, 0] = [7, 6] if set(own[1, 0]) != {6, 7} else [0, 1]
    captured[3] = -1  # free: not compared
    assert routing_agreement(own, captured) == (3 * 3 - 1, 9)
