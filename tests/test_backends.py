"""Backends against response fixtures written by hand, and against our own engine."""

import json
import math

import httpx
import numpy as np
import pytest

from support_replay import SamplingParams, WireError
from support_replay.backends import EngineBackend, SGLangBackend, VLLMBackend
from support_replay.engine import Engine
from support_replay.protocol import GenerateRequest

VOCAB = 50


def req(**kw):
    return GenerateRequest([1, 2, 3], SamplingParams(top_k=4, top_p=0.9, seed=1), max_new_tokens=2, return_sampling_mask=True, **kw)


def mock(handler):
    return httpx.MockTransport(handler)


def sglang_item(mask=None, logprobs=None, output_ids=(7, 3)):
    meta = {"finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2}
    if mask is not None:
        meta.update(output_token_sampling_mask=mask, output_token_sampling_logprobs=logprobs,
                    output_token_sampling_mask_length=len(mask))
    return {"text": "xy", "output_ids": list(output_ids), "meta_info": meta}


def test_sglang_backend_reads_native_fields():
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(200, json=sglang_item([[7, 9, 1], [3]], [math.log(0.6), 0.0]))

    b = SGLangBackend("http://sglang", VOCAB, transport=mock(handler))
    (c,) = b.generate([req()])
    assert seen["return_sampling_mask"] is True and seen["sampling_params"]["top_k"] == 4
    assert seen["sampling_params"]["sampling_seed"] == 1
    assert c.output_ids == [7, 3] and c.support.to_lists() == [[1, 7, 9], [3]]
    assert c.log_mu.tolist() == pytest.approx([math.log(0.6), 0.0])


@pytest.mark.parametrize("item, message", [
    (sglang_item(), "router on the path .* may have stripped it"),
    (sglang_item([[7, 9], [4]], [-0.5, 0.0]), "selected token 3 is not in its support"),
    (sglang_item([[7, 9], [3, 3]], [-0.5, -0.1]), "duplicate id 3"),
    (sglang_item([[7, 99], [3]], [-0.5, 0.0]), "outside the vocabulary"),
    (sglang_item([[7, 9]], [-0.5]), "1 support rows for 2 output tokens"),
    (sglang_item([[7, 9], [3]], [-0.5, float("nan")]), "token 1: log mu nan is not a finite value"),
    (sglang_item([[7, 9], [3]], [-0.5, -0.3]), "singleton support but log mu"),
])
def test_sglang_backend_fails_closed(item, message):
    b = SGLangBackend("http://sglang", VOCAB, transport=mock(lambda r: httpx.Response(200, content=json.dumps(item))))
    with pytest.raises(WireError, match=message):
        b.generate([req()])


def test_sglang_backend_http_error():
    b = SGLangBackend("http://sglang", VOCAB, transport=mock(lambda r: httpx.Response(400, json={"error": "top_k too large"})))
    with pytest.raises(WireError, match="HTTP 400"):
        b.generate([req()])


def vllm_choice(top, tokens=(7, 3), sampled=None, mask=None):
    sampled = sampled if sampled is not None else [t[f"token_id:{tok}"] for t, tok in zip(top, tokens)]
    choice = {
        "index": 0, "text": "xy", "finish_reason": "length",
        "logprobs": {"tokens": [f"token_id:{t}" for t in tokens], "token_logprobs": sampled, "top_logprobs": top},
    }
    if mask is not None:
        choice["sampling_mask"] = mask
    return {"choices": [choice]}


def test_vllm_processed_logprobs():
    top = [
        {"token_id:7": math.log(0.7), "token_id:9": math.log(0.3), "token_id:1": -9999.0, "token_id:2": -9999.0, "token_id:4": -9999.0},
        {"token_id:3": 0.0, "token_id:1": -9999.0, "token_id:2": -9999.0, "token_id:4": -9999.0, "token_id:5": -9999.0},
    ]
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(200, json=vllm_choice(top))

    b = VLLMBackend("http://vllm", "m", VOCAB, transport=mock(handler))
    (c,) = b.generate([req()])
    assert seen["logprobs"] == 5 and seen["return_tokens_as_token_ids"] is True and seen["top_k"] == 4
    assert c.support.to_lists() == [[7, 9], [3]] and c.log_mu.tolist() == pytest.approx([math.log(0.7), 0.0])


def test_vllm_fails_closed_when_all_entries_finite():
    top = [{f"token_id:{i}": -1.6 for i in (7, 1, 2, 4, 5)}, {"token_id:3": 0.0, "token_id:1": -9999.0}]
    b = VLLMBackend("http://vllm", "m", VOCAB, transport=mock(lambda r: httpx.Response(200, json=vllm_choice(top))))
    with pytest.raises(WireError, match="completion 0: top_logprobs\\[0\\]: all 5 returned entries are finite"):
        b.generate([req()])


def test_vllm_native_mask():
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(200, json=vllm_choice([{}, {}], sampled=[-0.4, 0.0], mask=[{"token_ids": [2, 7]}, {"token_ids": [3]}]))

    b = VLLMBackend("http://vllm", "m", VOCAB, mode="native", transport=mock(handler))
    (c,) = b.generate([req()])
    assert seen["return_sampling_mask"] is True
    assert c.support.to_lists() == [[2, 7], [3]] and c.log_mu.tolist() == pytest.approx([-0.4, 0.0])
    b = VLLMBackend("http://vllm", "m", VOCAB, mode="native", transport=mock(lambda r: httpx.Response(200, json=vllm_choice([{}, {}], sampled=[-0.4, 0.0]))))
    with pytest.raises(WireError, match="no sampling_mask in the response"):
        b.generate([req()])


def test_vllm_rejects_full_logprobs_request():
    b = VLLMBackend("http://vllm", "m", VOCAB, transport=mock(lambda r: httpx.Response(500)))
    with pytest.raises(WireError, match="full-vocabulary log-probs are not available"):
        b.generate([req(return_logprob=True)])


def test_engine_backend_and_http_backend_agree(tiny_checkpoint):
    from fastapi.testclient import TestClient

    from support_replay.serving.server import create_app

    engine = Engine.from_pretrained(tiny_checkpoint)
    local = EngineBackend(engine)
    reqs = [GenerateRequest([5, 6, 7 + i], SamplingParams(top_k=16, top_p=0.9, seed=i), max_new_tokens=6, return_sampling_mask=True, return_logprob=True) for i in range(3)]
    reqs.append(GenerateRequest([9, 9], SamplingParams(top_k=8, seed=9), max_new_tokens=4))  # evaluation: no capture
    a = local.generate(reqs)
    with TestClient(create_app(engine)) as client:
        transport = httpx.MockTransport(lambda r: _relay(client, r))
        for fmt in ("lists", "binary"):
            b = SGLangBackend("http://testserver", engine.vocab_size, sampling_mask_format=fmt, transport=transport).generate(reqs)
            for x, y in zip(a, b):
                assert x.output_ids == y.output_ids
                assert (x.support is None) == (y.support is None)
                if x.support is not None:
                    assert x.support == y.support
                    # batches differ (HTTP requests reach the engine one by one),
                    # so logits may differ in the last bit until the engine is batch-invariant
                    np.testing.assert_allclose(x.log_mu, y.log_mu, atol=1e-5, rtol=0)
    engine.shutdown()


def _relay(client, request: httpx.Request) -> httpx.Response:
    r = client.request(request.method, request.url.path, content=request.content, headers=dict(request.headers))
    return httpx.Response(r.status_code, content=r.content, headers=dict(r.headers))
