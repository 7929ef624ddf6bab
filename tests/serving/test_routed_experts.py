"""``serve`` answers ``return_routed_experts`` in SGLang's shape (raw int32) or vLLM's compact .npy,
and the SGLang backend reads both, the same routing as the in-process engine."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from fastapi.testclient import TestClient

from support_replay import SamplingParams
from support_replay.backends.local import EngineBackend
from support_replay.backends.sglang import SGLangBackend
from support_replay.core.routing import RoutingShape
from support_replay.engine import Engine, EngineSettings
from support_replay.errors import WireError
from support_replay.protocol import GenerateRequest
from support_replay.serving.server import create_app
from support_replay.serving.threaded import ThreadedServer


@pytest.fixture(scope="module")
def moe_app(tiny_moe_checkpoint):
    engine = Engine.from_pretrained(tiny_moe_checkpoint, EngineSettings(deterministic=True, linear_kernel="torch"))
    server = ThreadedServer(create_app(engine)).start()
    with TestClient(create_app(engine, start_engine=False, allowed_hosts=["testserver"])) as client:
        yield engine, client, server.url
    server.stop()
    engine.shutdown()


def backend(engine, url, shape="model", drop=()):
    """An SGLang backend on our server; ``drop`` leaves fields out of its bodies (SGLang's raw form, a router)."""
    shape = engine.runner.routing.shape if shape == "model" else shape
    out = SGLangBackend(url, engine.vocab_size, routing_shape=shape)
    body = out.body
    out.body = lambda req: {k: v for k, v in body(req).items() if k not in drop}
    return out


def request(i: int = 0) -> GenerateRequest:
    return GenerateRequest(
        [5, 6, 7, 8 + i],
        SamplingParams(temperature=1.0, top_p=0.9, seed=i),
        max_new_tokens=6,
        return_sampling_mask=True,
        return_routed_experts=True,
    )


def test_sglangs_shape_is_raw_int32_of_every_fed_position(moe_app):
    engine, client, _ = moe_app
    body = {
        "input_ids": [5, 6, 7, 8],
        "sampling_params": {"max_new_tokens": 6, "seed": 0},
        "return_routed_experts": True,
    }
    out = client.post("/generate", json=body).json()
    raw = base64.b64decode(out["meta_info"]["routed_experts"])
    positions = 4 + len(out["output_ids"]) - 1
    assert len(raw) == positions * 2 * 2 * 4  # [positions, layers, top_k] int32, no header
    start = client.post("/generate", json={**body, "routed_experts_start_len": 3}).json()
    assert base64.b64decode(start["meta_info"]["routed_experts"]) == raw[3 * 16 :]  # SGLang's [start, seqlen - 1)
    refused = client.post("/generate", json={**body, "routed_experts_start_len": 5})
    assert refused.status_code == 400 and "routed_experts_start_len: 5 is past the 4 input tokens" in refused.text


def test_the_backend_reads_both_forms_as_the_engine_routed(moe_app):
    engine, _, url = moe_app
    local = EngineBackend(engine).generate([request(i) for i in range(3)])
    compact, raw = backend(engine, url), backend(engine, url, drop=("routed_experts_format",))
    for remote_backend in (compact, raw):
        remote = remote_backend.generate([request(i) for i in range(3)])
        for a, b in zip(local, remote):
            assert a.output_ids == b.output_ids and np.array_equal(a.routed_experts, b.routed_experts)
    per_token_compact = compact.generate([request(0)])[0]
    per_token_raw = raw.generate([request(0)])[0]
    # uint8 .npy (a 128-byte header, 172 base64 characters) against int32: a quarter of the bytes per position
    assert per_token_compact.routing_bytes - 172 <= per_token_raw.routing_bytes / 4 + 4


def test_routing_the_backend_cannot_read_or_that_does_not_fit_fails_closed(moe_app):
    engine, _, url = moe_app
    with pytest.raises(WireError, match="raw int32 form needs the model's layer count and top-k"):
        backend(engine, url, shape=None, drop=("routed_experts_format",)).generate([request()])
    with pytest.raises(WireError, match="routed experts were requested but the response carries none"):
        backend(engine, url, drop=("return_routed_experts",)).generate([request()])
    wider = RoutingShape(layers=3, top_k=2, num_experts=8, moe_layers=(0, 1, 2))
    with pytest.raises(WireError, match="routing for 2 layers, the model has 3"):
        backend(engine, url, shape=wider).generate([request()])


def test_the_openai_endpoints_refuse_routed_experts_by_name(moe_app):
    _, client, _ = moe_app
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "return_routed_experts": True}
    refused = client.post("/v1/chat/completions", json=body)
    assert refused.status_code in (400, 422) and "return_routed_experts" in refused.text
