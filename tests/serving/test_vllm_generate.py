"""vLLM's ``/inference/v1/generate`` on ``serve`` and through the router: our ``VLLMBackend`` (both of its
captures) reads the same completions from it as ``SGLangBackend`` reads from ``/generate``; the entries
keep the rules verifiers' train client (``renderers.client``) checks; what it cannot do is refused by name."""

import math

import httpx
import numpy as np
import pytest

from support_replay.backends.sglang import SGLangBackend
from support_replay.backends.vllm import VLLMBackend
from support_replay.core.sampling import SamplingParams
from support_replay.protocol import GenerateRequest

ROUTE = "/inference/v1/generate"


@pytest.fixture(scope="module")
def served(served_with_router):
    return served_with_router


def requests(engine) -> list[GenerateRequest]:
    ids = engine.tokenizer("What is 12 plus 7?")["input_ids"]
    settings = [SamplingParams(top_k=20, top_p=0.9, seed=4), SamplingParams(top_k=5, min_p=0.05, seed=5)]
    return [GenerateRequest(list(ids), p, max_new_tokens=6, return_sampling_mask=True) for p in settings]


@pytest.mark.parametrize("capture", ["native", "processed_logprobs"])
def test_vllm_backend_reads_what_sglang_backend_reads(served, capture):
    engine, url, router_url = served
    vocab = engine.vocab_size
    for req in requests(engine):
        (ours,) = SGLangBackend(url, vocab).generate([req])
        for base in (url, router_url):
            (theirs,) = VLLMBackend(base, vocab, capture=capture).generate([req])
            assert theirs.output_ids == ours.output_ids
            assert theirs.support.to_lists() == ours.support.to_lists()
            np.testing.assert_array_equal(theirs.log_mu, ours.log_mu)  # the same floats, to the bit
            assert [s.to_json() for s in theirs.weight_versions] == [s.to_json() for s in ours.weight_versions]


def test_the_entries_keep_the_rules_the_train_client_checks(served):
    _, url, router_url = served
    # verifiers' train client (renderers 0.1.12, renderers/client.py): logprobs=1, skip_special_tokens false,
    # stop_token_ids, and per entry ``token == "token_id:N"`` with a finite log-prob other than -9999
    body = {
        "model": "tiny",
        "token_ids": [5, 6, 7, 8],
        "sampling_params": {"max_tokens": 6, "temperature": 1.0, "logprobs": 1, "skip_special_tokens": False},
    }
    for base in (url, router_url):
        r = httpx.post(base + ROUTE, json={**body, "sampling_params": {**body["sampling_params"], "seed": 1}})
        assert r.status_code == 200, r.text
        data = r.json()
        (choice,) = data["choices"]
        content = choice["logprobs"]["content"]
        assert len(content) == len(choice["token_ids"]) == data["usage"]["completion_tokens"]
        for token, entry in zip(choice["token_ids"], content):
            assert entry["token"] == f"token_id:{token}" and entry["token_id"] == token
            assert math.isfinite(entry["logprob"]) and entry["logprob"] != -9999.0 and entry["logprob"] <= 0
            tops = entry["top_logprobs"]
            assert tops[0]["token_id"] == token and 1 <= len(tops) <= 2  # the sampled token, then the most likely
        assert choice["sampling_mask"] is None and choice["finish_reason"] in ("stop", "length")
        assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": len(choice["token_ids"])}]


def test_n_text_mode_and_refusals(served):
    _, url, _ = served
    sp = {"max_tokens": 4, "top_k": 8, "seed": 3, "n": 2, "logprobs": -1}
    r = httpx.post(url + ROUTE, json={"token_ids": [5, 6, 7], "sampling_params": sp, "return_token_ids": True})
    assert r.status_code == 200, r.text
    data = r.json()
    assert len(data["choices"]) == 2 and data["prompt_token_ids"] == [5, 6, 7]
    for choice in data["choices"]:  # logprobs=-1: every id of the support, the sampled one first
        for token, row, entry in zip(choice["token_ids"], choice["sampling_mask"], choice["logprobs"]["content"]):
            assert {e["token_id"] for e in entry["top_logprobs"]} == set(row) and token in row
            assert abs(sum(math.exp(e["logprob"]) for e in entry["top_logprobs"]) - 1.0) < 1e-5
    text = httpx.post(
        url + ROUTE, json={"token_ids": [5, 6], "sampling_params": {"max_tokens": 3, "seed": 1}, "output_mode": "text"}
    ).json()["choices"][0]
    assert isinstance(text["text"], str) and text["logprobs"] is None
    for bad, why in [
        ({"sampling_params": {"logprobs": -1}}, "logprobs=-1 lists every id of the support"),
        ({"sampling_params": {"logprobs": 21}}, "at most 20 ids of the full distribution per token"),
        (
            {"sampling_params": {"structured_outputs": {"structural_tag": "{}"}}},
            "['structural_tag'] are not implemented",
        ),
        ({"sampling_params": {"frobnicate": 1}}, "frobnicate: not a field of sampling_params of " + ROUTE),
        ({"stream": True}, "streaming /inference/v1/generate is not implemented"),
        ({"features": {"mm_hashes": {}}}, "media input is not implemented"),
        ({"token_ids": []}, "token_ids"),
    ]:
        r = httpx.post(url + ROUTE, json={"token_ids": [5, 6], **bad})
        assert r.status_code == 400 and why in r.json()["error"]["message"], (bad, r.text)
