"""Backends: errors, the requests they send, and the in-process engine against the HTTP path.

Payloads from the engines' own code are tested in test_engine_payloads.py."""

import json

import httpx
import numpy as np
import pytest

from support_replay import SamplingParams, WireError
from support_replay.backends import EngineBackend, SGLangBackend, VLLMBackend
from support_replay.engine import Engine
from support_replay.protocol import GenerateRequest

VOCAB = 50


def req(**kw):
    return GenerateRequest(
        [1, 2, 3], SamplingParams(top_k=4, top_p=0.9, seed=1), max_new_tokens=2, return_sampling_mask=True, **kw
    )


def mock(handler):
    return httpx.MockTransport(handler)


def test_sglang_backend_http_error():
    b = SGLangBackend(
        "http://sglang", VOCAB, transport=mock(lambda r: httpx.Response(400, json={"error": "top_k too large"}))
    )
    with pytest.raises(WireError, match="HTTP 400"):
        b.generate([req()])


def test_a_request_aborted_by_a_weight_update_is_unavailable_not_a_wire_error():
    """serve answers 499 for a request a weight update (abort mode) dropped before it ran: the
    rollout treats it as no answer (the group is generated again), never as a malformed reply."""
    from support_replay.errors import EngineUnavailable

    aborted = lambda r: httpx.Response(
        499, json={"error": {"message": "a weight update aborted it (abort mode)", "code": 499}}
    )  # noqa: E731
    with pytest.raises(EngineUnavailable, match="aborted it \\(HTTP 499"):
        SGLangBackend("http://sglang", VOCAB, transport=mock(aborted)).generate([req()])


def test_sglang_sends_every_sampling_setting_explicitly():
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(400, json={"error": "stop here"})

    with pytest.raises(WireError, match="HTTP 400"):
        SGLangBackend("http://sglang", VOCAB, transport=mock(handler)).generate([req()])
    params = seen["sampling_params"]
    assert (params["frequency_penalty"], params["presence_penalty"], params["repetition_penalty"]) == (0.0, 0.0, 1.0)
    assert seen["return_sampling_mask"] is True and seen["sampling_mask_format"] == "binary"


def test_vllm_rejects_full_logprobs_request():
    b = VLLMBackend("http://vllm", VOCAB, model="m", transport=mock(lambda r: httpx.Response(500)))
    with pytest.raises(WireError, match="full-vocabulary log-probs are not available"):
        b.generate([req(return_logprob=True)])


def test_vllm_sends_every_sampling_setting_explicitly():
    """vLLM fills settings a request leaves out from the model's generation_config.json."""
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(400, json={"error": "stop here"})

    b = VLLMBackend("http://vllm", VOCAB, model="m", transport=mock(handler))
    with pytest.raises(WireError, match="HTTP 400"):
        b.generate([req()])
    params = seen["sampling_params"]
    assert {k: params[k] for k in ("presence_penalty", "frequency_penalty", "repetition_penalty")} == {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
    }
    assert params["temperature"] == 1.0 and params["top_k"] == 4 and params["top_p"] == 0.9 and params["min_p"] == 0.0
    assert params["logprobs"] == 5 and seen["token_ids"] == [1, 2, 3] and seen["output_mode"] == "tokens"


def _sent(backend_class, **request_fields) -> dict:
    seen = {}

    def handler(request):
        seen.update(json.loads(request.content))
        return httpx.Response(400, json={"error": "stop here"})

    extra = {"model": "m"} if backend_class is VLLMBackend else {}
    with pytest.raises(WireError, match="HTTP 400"):
        backend_class("http://engine", VOCAB, transport=mock(handler), **extra).generate([req(**request_fields)])
    return seen["sampling_params"]


@pytest.mark.parametrize("backend_class", [SGLangBackend, VLLMBackend])
def test_a_request_naming_its_sent_fields_leaves_the_others_to_the_engine(backend_class):
    """The audit's client sends what a user's client would: an unset setting takes the engine's default."""
    params = _sent(backend_class, sent_sampling_fields=frozenset({"top_p"}))
    assert params["top_p"] == 0.9
    for name in ("temperature", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        assert name not in params
    assert "seed" in params or "sampling_seed" in params  # not a sampling setting: always sent
    with pytest.raises(Exception, match="sent_sampling_fields"):
        req(sent_sampling_fields=frozenset({"top_q"}))


def test_a_sampler_record_other_than_the_request_fails_closed():
    from support_replay import SupportTable
    from support_replay.errors import SamplerMismatch
    from support_replay.protocol import Completion, sampler_record, validate_completion

    request = req()
    record = sampler_record(request, semantics="sglang", version="0.1.0")
    completion = Completion(
        [2, 3], {"type": "length"}, np.zeros(2, np.float32), SupportTable.from_lists([[2], [3]]), sampler=record
    )
    assert validate_completion(completion, request, VOCAB) is completion
    for name, value in (("top_k", 5), ("temperature", 0.7), ("repetition_penalty", 1.1)):
        completion.sampler = {**record, name: value}
        with pytest.raises(SamplerMismatch, match=f"sampled with {name}={value}, the run's is"):
            validate_completion(completion, request, VOCAB, 3)
    completion.sampler = {"engine": "support-replay"}
    with pytest.raises(SamplerMismatch, match="lacks"):
        validate_completion(completion, request, VOCAB)


def test_engine_backend_and_http_backend_agree(tiny_checkpoint):
    from fastapi.testclient import TestClient

    from support_replay.serving.server import create_app

    engine = Engine.from_pretrained(tiny_checkpoint)
    local = EngineBackend(engine)
    reqs = [
        GenerateRequest(
            [5, 6, 7 + i],
            SamplingParams(top_k=16, top_p=0.9, seed=i),
            max_new_tokens=6,
            return_sampling_mask=True,
            return_logprob=True,
        )
        for i in range(3)
    ]
    reqs.append(GenerateRequest([9, 9], SamplingParams(top_k=8, seed=9), max_new_tokens=4))  # evaluation: no capture
    a = local.generate(reqs)
    with TestClient(create_app(engine)) as client:
        transport = httpx.MockTransport(lambda r: _relay(client, r))
        for fmt in ("lists", "binary"):
            b = SGLangBackend(
                "http://testserver", engine.vocab_size, sampling_mask_format=fmt, transport=transport
            ).generate(reqs)
            for x, y in zip(a, b):
                assert x.output_ids == y.output_ids
                assert (x.support is None) == (y.support is None)
                if x.support is not None:
                    assert x.support == y.support
                    assert y.sampler == x.sampler and y.sampler["top_k"] == 16  # the record crossed the wire
                    # batches differ (HTTP requests reach the engine one by one),
                    # so logits may differ in the last bit until the engine is batch-invariant
                    np.testing.assert_allclose(x.log_mu, y.log_mu, atol=1e-5, rtol=0)
    engine.shutdown()


def _relay(client, request: httpx.Request) -> httpx.Response:
    r = client.request(request.method, request.url.path, content=request.content, headers=dict(request.headers))
    return httpx.Response(r.status_code, content=r.content, headers=dict(r.headers))
