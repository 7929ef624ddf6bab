"""The engine server through FastAPI's test client: schemas, fields, errors."""

import math

import pytest
import torch
from fastapi.testclient import TestClient

from support_replay.backends.sglang import parse_meta_info
from support_replay.engine import Engine, EngineSettings
from support_replay.serving.security import Keys
from support_replay.serving.server import create_app


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    eng = Engine.from_pretrained(tiny_checkpoint, EngineSettings(sampling_mask_max_tokens=64)).start()
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(engine):
    with TestClient(create_app(engine, max_request_bytes=20000)) as c:
        yield c


def test_generate_text_with_capture(client, engine):
    r = client.post(
        "/generate",
        json={
            "text": "What is 12 plus 7?",
            "sampling_params": {"temperature": 1.0, "top_k": 20, "top_p": 0.9, "max_new_tokens": 8, "seed": 3},
            "return_sampling_mask": True,
            "return_logprob": True,
        },
    )
    assert r.status_code == 200, r.text
    body = r.json()
    meta = body["meta_info"]
    assert len(body["output_ids"]) == meta["completion_tokens"] == 8
    table, logmu, *_ = parse_meta_info(meta, body["output_ids"], engine.vocab_size)
    assert len(logmu) == 8 and meta["output_token_sampling_mask_length"] == 8  # SGLang's shape: the number of rows
    assert isinstance(meta["output_token_sampling_mask"], list)  # lists unless the binary form was asked
    assert meta["weight_version"] == "default" and meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": 8}
    ]
    assert [e[1] for e in meta["output_token_logprobs"]] == body["output_ids"]
    assert meta["finish_reason"] == {"type": "length", "length": 8}


def test_generate_batch_of_ids_binary_and_support_mode(client, engine):
    ids = engine.tokenizer("Compute 3 times 4.")["input_ids"]
    r = client.post(
        "/generate",
        json={
            "input_ids": [ids, ids[:3]],
            "sampling_params": [
                {"top_k": 10, "max_new_tokens": 5, "seed": 1},
                {"top_k": 5, "max_new_tokens": 4, "seed": 2},
            ],
            "return_sampling_mask": True,
            "sampling_mask_format": "binary",
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()
    assert [len(o["output_ids"]) for o in out] == [5, 4]
    for o in out:
        table, *_ = parse_meta_info(o["meta_info"], o["output_ids"], engine.vocab_size)
        assert table.num_rows == len(o["output_ids"])
        assert isinstance(o["meta_info"]["output_token_sampling_mask"], str)
    r = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"top_k": 6, "max_new_tokens": 3, "seed": 5},
            "return_sampling_mask": True,
            "sampling_logprobs_mode": "support",
        },
    )
    meta = r.json()["meta_info"]
    rows = meta["output_token_sampling_logprobs"]
    for row, mask_row in zip(rows, meta["output_token_sampling_mask"]):
        assert len(row) == len(mask_row) and math.isclose(sum(math.exp(v) for v in row), 1.0, rel_tol=1e-5)
    table, logmu, *_ = parse_meta_info(meta, r.json()["output_ids"], engine.vocab_size)
    same = client.post(
        "/generate",
        json={
            "input_ids": ids,
            "sampling_params": {"top_k": 6, "max_new_tokens": 3, "seed": 5},
            "return_sampling_mask": True,
        },
    ).json()["meta_info"]["output_token_sampling_logprobs"]
    assert logmu.tolist() == pytest.approx(same, abs=0)


def test_chat_completions_with_meta_info(client, engine):
    r = client.post(
        "/v1/chat/completions",
        json={
            "model": "tiny",
            "messages": [{"role": "user", "content": "What is 12 plus 7?"}],
            "temperature": 1.0,
            "top_p": 0.8,
            "top_k": 32,
            "max_tokens": 6,
            "seed": 0,
            "return_sampling_mask": True,
            "return_meta_info": True,
            "logprobs": True,
        },
    )
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    meta = choice["meta_info"]
    table, _ = parse_meta_info(meta, meta["output_ids"], engine.vocab_size)[:2]
    assert table.num_rows == r.json()["usage"]["completion_tokens"] == len(choice["logprobs"]["content"])
    # without return_meta_info the client sees a plain OpenAI response
    plain = client.post(
        "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
    ).json()
    assert "meta_info" not in plain["choices"][0]


def test_info_endpoints(client, engine):
    assert client.get("/health").json()["status"] == "ok"
    info = client.get("/model_info").json()
    assert info["vocab_size"] == engine.vocab_size and info["sampling_mask_max_tokens"] == 64
    assert (
        info["linear_kernel"] == engine.linear_kernel and info["deterministic"] is False
    )  # a true-on-policy trainer checks both
    assert info["decode_attention"] == engine.decode_attention in ("kernel", "sdpa")
    assert info["page_size"] == 16 and info["kv_blocks"]["total"] == engine.kv_budget.max_total_tokens // 16
    assert client.post("/flush_cache").json()["success"] is True


@pytest.mark.parametrize(
    "payload, status, message",
    [
        ({}, 400, "exactly one of text or input_ids"),
        ({"text": "a", "input_ids": [1]}, 400, "exactly one"),
        ({"input_ids": [1, 99999]}, 400, "token 99999 outside the vocabulary"),
        ({"input_ids": []}, 400, "input_ids: the prompt is empty"),
        ({"text": "a", "sampling_params": {"top_p": 0}}, 400, "top_p: must be in"),
        ({"text": "a", "sampling_params": {"top_k": 0}}, 400, "top_k: must be -1"),
        ({"text": "a", "sampling_params": {"temperature": -1}}, 400, "temperature"),
        (
            {"text": "a", "sampling_params": {"temperature": 0, "top_p": 0.5}},
            400,
            "temperature: must be > 0 when a support filter",
        ),
        ({"text": "a", "sampling_params": {"max_new_tokens": 0}}, 400, "max_new_tokens"),
        ({"text": "a", "sampling_params": {"repetition_penalty": 0}}, 400, "repetition_penalty: must be in (0, 2]"),
        (
            {"text": "a", "sampling_params": {"logit_bias": {"99999": 1.0}}},
            400,
            "logit_bias id 99999 is outside the vocabulary",
        ),
        ({"text": "a", "sampling_params": {"logit_bias": {"x": 1.0}}}, 400, "logit_bias: 'x' is not a token id"),
        ({"text": "a", "sampling_params": {"top_a": 0.5}}, 400, "top_a"),
        (
            {"text": "a", "sampling_params": {"top_k": 100}, "return_sampling_mask": True},
            400,
            "exceeds sampling_mask_max_tokens=64",
        ),
        ({"text": ["a", "b"], "stream": True}, 400, "a streamed /generate takes one prompt"),
        ({"text": ["a", "b"], "sampling_params": [{}]}, 400, "1 / 2 entries for 2 prompts"),
        ({"text": "a", "sampling_logprobs_mode": "all"}, 400, "sampling_logprobs_mode"),
        ({"text": 5}, 400, "text"),
    ],
)
def test_malformed_generate_requests(client, payload, status, message):
    r = client.post("/generate", json=payload)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_malformed_bodies(client):
    assert (
        client.post("/generate", content=b"{not json", headers={"content-type": "application/json"}).status_code == 400
    )
    assert client.post("/generate", content=b"x" * 30000).status_code == 413
    r = client.post("/v1/chat/completions", json={"messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "top_logprobs": 30})
    assert r.status_code == 400 and "top_logprobs" in r.json()["error"]["message"]
    assert (
        client.post("/update_weights_from_disk", json={"model_path": "/nonexistent"}).status_code == 403
    )  # no --weights-dir
    assert client.get("/health").status_code == 200  # still serving


def test_api_key(engine):
    with TestClient(create_app(engine, keys=Keys(api="sekrit"))) as c:
        assert c.get("/health").status_code == 200
        assert c.get("/model_info").status_code == 401
        assert c.get("/model_info", headers={"Authorization": "Bearer sekrit"}).status_code == 200


def test_weights_in_the_body_need_the_admin_key_and_a_safetensors_file(engine):
    from safetensors.torch import save

    state = {k: v.clone() for k, v in engine.runner.model.state_dict().items()}
    body = save(state)
    binary = {"Content-Type": "application/octet-stream"}
    with TestClient(create_app(engine)) as open_server:  # no admin key: a web page could post this
        r = open_server.post("/update_weights_from_safetensors", content=body, headers=binary)
        assert r.status_code == 403 and "--admin-key-file" in r.json()["error"]["message"]
    admin = {"Authorization": "Bearer root", **binary}
    with TestClient(create_app(engine, keys=Keys(admin="root"), max_weights_bytes=len(body))) as c:
        assert c.post("/update_weights_from_safetensors", content=body, headers=binary).status_code == 401
        r = c.post(
            "/update_weights_from_safetensors", content=body, headers={**admin, "Content-Type": "application/json"}
        )
        assert r.status_code == 415
        r = c.post("/update_weights_from_safetensors", content=b"not a safetensors file", headers=admin)
        assert r.status_code == 400 and "not a safetensors file" in r.json()["error"]["message"]
        r = c.post("/update_weights_from_safetensors", content=save({"no.such.weight": torch.zeros(2)}), headers=admin)
        assert r.status_code == 400 and "no.such.weight" in r.json()["error"]["message"]
        assert c.post("/update_weights_from_safetensors", content=body + b"x", headers=admin).status_code == 413
        r = c.post("/update_weights_from_safetensors", content=body, params={"weight_version": "w7"}, headers=admin)
        assert r.status_code == 200 and r.json()["weight_version"] == "w7"
        assert c.get("/model_info").json()["weight_version"] == "w7"
    engine.update_weight_version("default").result()  # the module's engine as the other tests found it
