"""Fuzz targets, run by tests/serving/test_fuzz.py with a few hundred inputs each and by bench/fuzz.py with
the full counts (docs/reliability.md). Each returns what it saw; a broken promise raises.

- ``fuzz_wire``: valid encodings (both modes), then hypothesis mutates them: flipped bits,
  changed header fields, truncation, splices, appended bytes. ``decode`` must raise only
  ``WireError`` or give a table that re-encodes to itself; peak memory per input byte is measured.
- ``fuzz_sglang`` / ``fuzz_vllm``: the fixture payloads with values replaced by arbitrary JSON
  (NaN and infinities, wrong types, missing keys, shortened lists): parsing and validation must
  raise only our errors.
- ``fuzz_http``: schemathesis draws requests from the server's OpenAPI schema (the request
  bodies are declared there): no answer may be a 5xx, none may hang.
"""

from __future__ import annotations

import copy
import json
import math
import time
import tracemalloc
from collections import Counter
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support_replay import SamplingParams, SupportReplayError, SupportTable, wire
from support_replay.backends.sglang import SGLangBackend
from support_replay.backends.vllm import VLLMBackend
from support_replay.protocol import GenerateRequest, validate_completion

FIXTURES = Path(__file__).parent / "engines" / "fixtures"


def _settings(n: int):
    return settings(
        max_examples=n, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck)
    )


# ---- the wire decoder ---------------------------------------------------------------------


@st.composite
def valid_streams(draw, relative: bool | None = None):
    vocab = draw(st.sampled_from([2, 50, 1000, 151936]))
    rows = [
        sorted(draw(st.sets(st.integers(0, vocab - 1), min_size=1, max_size=min(vocab, 24))))
        for _ in range(draw(st.integers(0, 12)))
    ]
    selected = [draw(st.sampled_from(r)) for r in rows]
    relative = draw(st.booleans()) if relative is None else relative
    table = SupportTable.from_lists(rows)
    return wire.encode(table, vocab, selected if relative else None), selected if relative else None, vocab


@st.composite
def mutated_streams(draw, relative: bool | None = None):
    blob, selected, vocab = draw(valid_streams(relative))
    data = bytearray(blob)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "header", "truncate", "append", "splice"]))
        if kind == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "header" and len(data) >= 26:
            i = draw(st.sampled_from([4, 5, 6, 10, 14, 18, 22]))
            data[i : i + 4] = draw(st.binary(min_size=4, max_size=4))
        elif kind == "truncate" and data:
            del data[draw(st.integers(0, len(data) - 1)) :]
        elif kind == "append":
            data += draw(st.binary(min_size=1, max_size=64))
        elif kind == "splice" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
    return bytes(data), selected, vocab


def worst_case_decode_memory() -> dict:
    """Peak memory of decoding the densest stream a header can announce: every gap zero, so one id
    per bit of the gap stream (4 MiB in, 8M ids out)."""
    import struct

    n_high, vocab = 1 << 19, 64
    counts = np.full(8 * n_high // 8, 8)
    head = wire._varint_encode(counts)
    low = int(sum((c * int(w) + 7) // 8 for c, w in zip(counts, wire._rice_widths(counts, vocab))))
    blob = (
        struct.pack("<4sBBIIIII", b"SRPW", 1, 0, len(counts), vocab, len(head), n_high, low)
        + head
        + b"\xff" * n_high
        + bytes(low)
    )
    tracemalloc.start()
    table = wire.decode(blob)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {
        "input_bytes": len(blob),
        "ids": table.nnz,
        "peak_bytes": peak,
        "peak_per_input_byte": round(peak / len(blob), 1),
    }


def fuzz_wire(n: int, measure_memory: bool = False, relative: bool | None = None) -> dict:
    seen = Counter()
    worst = [0.0]

    @_settings(n)
    @given(mutated_streams(relative))
    def one(case):
        data, selected, vocab = case
        if measure_memory:
            tracemalloc.start()
        try:
            table = wire.decode(data, selected)
        except SupportReplayError:
            seen["rejected"] += 1
            return
        finally:
            if measure_memory:
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
                worst[0] = max(worst[0], peak)
        seen["decoded"] += 1
        header_vocab = int.from_bytes(data[10:14], "little")
        relative = selected if data[5] & wire.FLAG_SELECTED_RELATIVE else None  # as the (maybe mutated) header says
        again = wire.decode(wire.encode(table, header_vocab, relative), relative)
        assert again == table, "a decoded table did not re-encode to itself"

    one()
    return {**seen, "peak_bytes_max": int(worst[0])}


# ---- engine payloads ----------------------------------------------------------------------

JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@st.composite
def edited(draw, payload):
    """The payload with a few of its values replaced, removed or cut short."""
    payload = copy.deepcopy(payload)
    paths = []

    def walk(node, path):
        paths.append(path)
        children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
        for key, child in children:
            walk(child, (*path, key))

    walk(payload, ())
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(paths[1:]))
        parent = payload
        try:
            for key in path[:-1]:
                parent = parent[key]
            action = draw(st.sampled_from(["replace", "remove", "truncate"]))
            if action == "replace":
                parent[path[-1]] = draw(JSON_VALUES)
            elif action == "remove":
                del parent[path[-1]]
            elif isinstance(parent[path[-1]], list):
                parent[path[-1]] = parent[path[-1]][: draw(st.integers(0, 3))]
        except (KeyError, IndexError, TypeError):
            pass  # an earlier edit removed the way there
    return json.loads(json.dumps(payload))  # what a JSON parser would hand over (NaN kept)


def _request(capture=True, mode="selected", top_k=8):
    return GenerateRequest(
        [1, 2, 3], SamplingParams(top_k=top_k, seed=1), return_sampling_mask=capture, sampling_logprobs_mode=mode
    )


def fuzz_sglang(n: int) -> dict:
    cases = json.loads((FIXTURES / "sglang-0.5.23.json").read_text())["cases"]
    seen = Counter()
    clients = {}  # one backend per vocabulary: making one (its HTTP client) costs more than parsing a payload

    @_settings(n)
    @given(st.sampled_from(cases).flatmap(lambda c: st.tuples(st.just(c), edited(c["response"]))))
    def one(pair):
        case, item = pair
        req = _request("sampled" in case, "support" if case["name"] == "support_mode" else "selected")
        if case["vocab_size"] not in clients:
            clients[case["vocab_size"]] = SGLangBackend("http://unused", case["vocab_size"])
        client = clients[case["vocab_size"]]
        try:
            validate_completion(client.completion(item, req), req, case["vocab_size"])
            seen["accepted"] += 1
        except SupportReplayError:
            seen["rejected"] += 1

    one()
    return dict(seen)


def fuzz_vllm(n: int) -> dict:
    cases = json.loads((FIXTURES / "vllm-0.32.0.json").read_text())["cases"]
    seen = Counter()
    clients = {}  # one backend per vocabulary and endpoint, as above

    @_settings(n)
    @given(st.sampled_from(cases).flatmap(lambda c: st.tuples(st.just(c), edited(c["response"]["choices"][0]))))
    def one(pair):
        case, choice = pair
        key = (case["vocab_size"], case["endpoint"])
        if key not in clients:
            clients[key] = VLLMBackend("http://unused", case["vocab_size"], model="tiny", endpoint=case["endpoint"])
        client = clients[key]
        req = _request(top_k=case["request"].get("sampling_params", case["request"])["top_k"])
        try:
            parse = client.parse_generate_choice if case["endpoint"] == "generate" else client.parse_completions_choice
            validate_completion(parse(choice, req), req, case["vocab_size"])
            seen["accepted"] += 1
        except SupportReplayError:
            seen["rejected"] += 1

    one()
    return dict(seen)


# ---- HTTP endpoints --------------------------------------------------------------------


def fuzz_http(app, n_per_operation: int, timeout: float = 30.0) -> dict:
    """Schema-driven requests to every operation of ``app``; returns answers by (operation, status)."""
    import schemathesis

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    seen = Counter()
    slowest = [0.0]
    for result in schema.get_all_operations():
        operation = result.ok()

        @_settings(n_per_operation)
        @given(operation.as_strategy())
        def one(case):
            start = time.monotonic()
            reply = case.call(timeout=timeout)
            slowest[0] = max(slowest[0], time.monotonic() - start)
            seen[(operation.label, reply.status_code)] += 1
            assert reply.status_code < 500, (
                f"{operation.label} answered {reply.status_code}: {reply.text[:300]} for {case.body!r:.300}"
            )

        one()
    return {"answers": dict(seen), "slowest_s": round(slowest[0], 3)}


def summary(counts: dict) -> str:
    return ", ".join(f"{k}: {v}" for k, v in counts.items() if not (isinstance(v, float) and math.isnan(v)))
