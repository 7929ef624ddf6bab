"""Routed experts as SGLang's and vLLM's own code write them (tests/engines/fixtures/routed-experts.json,
made by tests/engines/generate_routing_fixtures.py), read by our backends, and edits of them refused."""

from __future__ import annotations

import base64
import copy
import json
from pathlib import Path

import numpy as np
import pytest

from support_replay import SamplingParams
from support_replay.backends.sglang import SGLangBackend
from support_replay.backends.vllm import VLLMBackend
from support_replay.core.routing import RoutingShape, encode_npy
from support_replay.errors import WireError
from support_replay.protocol import GenerateRequest, validate_completion

FIXTURE = json.loads((Path(__file__).parents[1] / "engines" / "fixtures" / "routed-experts.json").read_text())
SHAPE = RoutingShape(**FIXTURE["model"], moe_layers=tuple(range(FIXTURE["model"]["layers"])))
VOCAB = 400


def request(case) -> GenerateRequest:
    return GenerateRequest(case["input_ids"], SamplingParams(), max_new_tokens=8, return_routed_experts=True)


def sglang_item(case, routed=None) -> dict:
    meta = {"finish_reason": {"type": "length"}, "weight_version": "default"}
    meta["routed_experts"] = case["sglang_routed_experts"] if routed is None else routed
    return {"text": "", "output_ids": case["output_ids"], "meta_info": meta}


def sglang(item, case, shape=SHAPE):
    backend = SGLangBackend("http://sglang", VOCAB, routing_shape=shape)
    req = request(case)
    return validate_completion(backend.completion(item, req), req, VOCAB, 0, shape)


def vllm(choice, case):
    backend = VLLMBackend("http://vllm", VOCAB, model="tiny", routing_shape=SHAPE)
    req = request(case)
    return validate_completion(backend.parse_generate_choice(choice, req), req, VOCAB, 0, SHAPE)


@pytest.mark.parametrize("i", range(len(FIXTURE["cases"])))
def test_both_engines_payloads_parse_to_the_routing_the_model_chose(i):
    case = FIXTURE["cases"][i]
    routing = np.asarray(case["routing"], np.int32)
    start = case["routed_experts_start_len"]
    if start == 0:
        assert np.array_equal(sglang(sglang_item(case), case).routed_experts, routing)
    else:  # SGLang's [start, seqlen - 1): a client that asks a start gets fewer positions, and says so
        backend = SGLangBackend("http://sglang", VOCAB, routing_shape=SHAPE)
        parsed = backend.completion(sglang_item(case), request(case)).routed_experts
        assert np.array_equal(parsed, routing[start:])
    assert np.array_equal(vllm(case["vllm_choice"], case).routed_experts, routing)
    raw = base64.b64decode(case["vllm_choice"]["routed_experts"])
    assert raw.startswith(b"\x93NUMPY") and "'descr': '|u1'" in raw[:128].decode("latin1")  # vLLM's uint8


def test_sglang_edits_fail_closed():
    case = FIXTURE["cases"][0]
    raw = base64.b64decode(case["sglang_routed_experts"])
    one_position = SHAPE.bytes_per_token(np.int32)
    short = base64.b64encode(raw[:-one_position]).decode()
    with pytest.raises(WireError, match="routing for 9 positions, expected 10"):
        sglang(sglang_item(case, short), case)
    with pytest.raises(WireError, match="not a whole number of positions"):
        sglang(sglang_item(case, base64.b64encode(raw[:-4]).decode()), case)
    values = np.frombuffer(raw, "<i4").copy()
    values[5] = 8
    with pytest.raises(WireError, match="position 1 layer 0: expert id 8 outside \\[0, 8\\)"):
        sglang(sglang_item(case, base64.b64encode(values.tobytes()).decode()), case)
    wide = RoutingShape(layers=1, top_k=4, num_experts=8, moe_layers=(0,))  # same bytes, read as another model
    with pytest.raises(WireError, match="repeat an expert|expected 10"):
        sglang(sglang_item(case), case, wide)
    item = sglang_item(case)
    del item["meta_info"]["routed_experts"]
    with pytest.raises(WireError, match="response carries none .*--enable-return-routed-experts"):
        sglang(item, case)


def test_vllm_edits_fail_closed():
    case = FIXTURE["cases"][0]
    routing = np.asarray(case["routing"], np.int32)
    edits = [
        (encode_npy(routing[:, :1], 8), "routing for 1 layers, the model has 2"),
        (encode_npy(routing[1:], 8), "routing for 9 positions, expected 10"),
        (encode_npy(np.where(routing == routing[3, 1, 0], 200, routing), 256), "expert id 200 outside"),
        ("AAAA", "not a .npy"),
        (None, "response carries none"),
    ]
    for routed, match in edits:
        choice = copy.deepcopy(case["vllm_choice"])
        choice["routed_experts"] = routed
        with pytest.raises(WireError, match=match):
            vllm(choice, case)


def test_the_routing_a_recompute_replaced_travels_in_our_serve_s_answer_and_a_switch_without_it_is_refused():
    """A request retracted after 2 outputs and recomputed under version "1": our serve sends the routing of the
    first computation in ``routed_experts_history`` (the same form as ``routed_experts``), the backend reads it
    back; SGLang's answer to the same request (one routing per position, the latest) is refused by name."""
    from support_replay.core.support import SupportTable
    from support_replay.protocol import Completion, VersionSpan
    from support_replay.serving.sglang_format import ResponseForm, meta_info

    case = FIXTURE["cases"][0]
    routing, req = np.asarray(case["routing"], np.int32), request(case)
    prompt, n = len(case["input_ids"]), len(case["output_ids"])
    earlier = (routing[: prompt + 1] + 1) % SHAPE.num_experts  # outputs 0 and 1 followed other experts
    spans = [VersionSpan("0", 0, 2), VersionSpan("1", 2, n)]
    done = Completion(
        case["output_ids"], {"type": "length"}, support=SupportTable.singleton(case["output_ids"]),
        log_mu=np.zeros(n, np.float32), weight_versions=spans, routed_experts=routing,
        routed_experts_history=[earlier],
    )  # fmt: skip
    for form in ("sglang", "npy"):
        meta = meta_info(done, req, form=ResponseForm(routed_experts_format=form), vocab_size=VOCAB, num_experts=8)
        parsed = sglang({"text": "", "output_ids": case["output_ids"], "meta_info": meta}, case)
        assert np.array_equal(parsed.routed_experts, routing)
        assert len(parsed.routed_experts_history) == 1 and np.array_equal(parsed.routed_experts_history[0], earlier)
        assert [s.version for s in parsed.weight_versions] == ["0", "1"]
    del meta["routed_experts_history"]
    with pytest.raises(WireError, match="output token 2 was sampled by version '1' after a switch.*one routing"):
        sglang({"text": "", "output_ids": case["output_ids"], "meta_info": meta}, case)
    meta["routed_experts_history"] = [encode_npy(routing, 8)]  # as long as the final computation: not earlier
    with pytest.raises(WireError, match=r"routed_experts_history\[0\] covers 10 positions"):
        sglang({"text": "", "output_ids": case["output_ids"], "meta_info": meta}, case)
