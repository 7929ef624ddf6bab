"""Real token streaming on ``serve``: chunks leave as tokens are sampled (many deltas, the first long
before the last token), the deltas concatenate to exactly the whole answer (stop strings, n, text
completions), and a client that goes away mid-stream aborts its request."""

import json
import time

import httpx
import pytest


@pytest.fixture(scope="module")
def served(served_with_router):
    return served_with_router


def sse(url: str, route: str, body: dict) -> list[dict]:
    events = []
    with httpx.stream("POST", url + route, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def chat_text(events: list[dict], i: int = 0) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or "" for c in events if c["choices"] and c["choices"][0]["index"] == i
    )


@pytest.mark.parametrize("extra", [{}, {"stop": [" the", "e"]}, {"n": 2, "seed": 4}, {"top_k": 8, "logprobs": True}])
def test_streamed_deltas_are_the_whole_answer(served, extra):
    _, url, _ = served
    body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 32, "seed": 3, **extra}
    whole = httpx.post(url + "/v1/chat/completions", json=body).json()
    events = sse(url, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
    for choice in whole["choices"]:
        assert chat_text(events, choice["index"]) == choice["message"]["content"]
    assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
    finishes = [c["choices"][0]["finish_reason"] for c in events if c["choices"] and c["choices"][0]["finish_reason"]]
    assert finishes == [c["finish_reason"] for c in whole["choices"]]
    if "logprobs" in extra:  # the log-probs of every token, in the choice's last content chunk
        streamed = [
            e
            for c in events
            if c["choices"] and c["choices"][0]["logprobs"]
            for e in c["choices"][0]["logprobs"]["content"]
        ]
        assert streamed == whole["choices"][0]["logprobs"]["content"]


def test_tokens_leave_as_they_are_sampled_through_the_router_too(served):
    _, url, router_url = served
    body = {"prompt": "Once upon a time", "max_tokens": 48, "ignore_eos": True, "seed": 1}
    whole = httpx.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
    for base in (url, router_url):
        events = sse(base, "/v1/completions", body)
        deltas = [c["choices"][0]["text"] for c in events if c["choices"][0]["text"]]
        assert "".join(deltas) == whole and len(deltas) >= 16  # one per token or few, not one at the end


@pytest.mark.parametrize("through", ["serve", "router"])
def test_a_client_that_goes_away_mid_stream_aborts_its_request(served, through):
    engine, server_url, router_url = served
    url = server_url if through == "serve" else router_url
    before = engine.stats.requests["aborted"]
    refused = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 5000, "stream": True})
    assert refused.status_code == 400  # refused before any chunk: a plain error, not a broken stream
    body = {"prompt": "Count:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = r.iter_lines()
        while not next(lines).startswith("data: "):
            pass
    for _ in range(100):
        if engine.stats.requests["aborted"] > before and engine.num_running == 0:
            break
        time.sleep(0.05)
    assert engine.stats.requests["aborted"] == before + 1 and engine.num_running == 0


def test_incremental_text_spells_multibyte_characters_whole_and_decodes_a_few_tokens_per_step(tmp_path):
    """The deltas, then the rest at the end, are the answer's text; a character spelled over several byte tokens
    leaves whole; each token costs a decode of a few tokens, not of the whole output again."""
    from support_replay.protocol import GenerateRequest
    from support_replay.serving.token_stream import IncrementalText
    from tiny_model import tiny_tokenizer

    tokenizer = tiny_tokenizer(tmp_path)
    text = "héllo wörld, ünïcode ✓ 日本語 and more plain words " * 8
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoded = []
    original = tokenizer.decode

    def counting(token_ids, **kw):
        decoded.append(len(token_ids))
        return original(token_ids, **kw)

    tokenizer.decode = counting
    stream = IncrementalText(tokenizer, GenerateRequest([1], stop=["zzz"]), eos_ids=set())
    deltas = [stream.push(t) for t in ids]
    tokenizer.decode = original
    full = tokenizer.decode(ids)
    assert "".join(deltas) + stream.finish(full) == full
    assert not any("\ufffd" in d for d in deltas)  # no half character ever left
    assert sum(decoded) <= 12 * len(ids)  # a few tokens per step (a whole re-decode would be ~len(ids)^2 / 2)


@pytest.mark.parametrize("through", ["serve", "router"])
def test_sglang_generate_streams_the_ids_so_far_then_the_whole_answer(served, through):
    """SGLang's streamed /generate (its default form): one chunk per token with the ids and text so far, then the
    very answer a plain /generate gives (support, log mu and all), then [DONE]."""
    _, serve_url, router_url = served
    url = serve_url if through == "serve" else router_url
    body = {"input_ids": [5, 6, 7, 8], "return_sampling_mask": True, "return_logprob": True}
    body["sampling_params"] = {"max_new_tokens": 10, "temperature": 1.0, "top_k": 16, "top_p": 0.9, "seed": 5}
    events = sse(url, "/generate", body)
    whole = httpx.post(url + "/generate", json=body, timeout=60).json()
    *progress, last = events
    assert [len(e["output_ids"]) for e in progress] == list(range(1, len(whole["output_ids"]) + 1))
    assert all(e["meta_info"]["finish_reason"] is None for e in progress)
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    assert {**last["meta_info"], "id": None} == {**whole["meta_info"], "id": None}
    assert whole["text"].startswith(progress[-2]["text"] if len(progress) > 1 else "")
    batched = httpx.post(url + "/generate", json={**body, "input_ids": [[5, 6], [7, 8]], "stream": True}, timeout=60)
    assert batched.status_code == 400 and "a streamed /generate takes one prompt" in batched.text
