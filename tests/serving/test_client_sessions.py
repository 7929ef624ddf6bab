"""Sessions a harness names itself (``X-Session-ID``, as verifiers sends it), task scopes whose ids make
one GRPO group, token-level turns in vLLM's generate shapes, and ``top_logprobs`` inside a session
whose backend carries the support in our binary form, over HTTP with the tiny engine."""

import asyncio
import json
import time

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from support_replay.backends.sglang import SGLangBackend
from support_replay.core.sampling import SamplingParams
from support_replay.engine import Engine, EngineSettings
from support_replay.rollout.chat import ChatRenderer, builtin_template
from support_replay.rollout.session import SessionSettings, SessionStore
from support_replay.serving.server import create_app
from support_replay.serving.sessions import create_sessions_app
from support_replay.serving.threaded import ThreadedServer

PARAMS = SamplingParams(temperature=1.0, top_k=32, top_p=0.8)
TOOLS = [{"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def served(tiny_agent_checkpoint):
    """Sessions in front of ``serve`` through SGLangBackend with binary masks (the trainer's transport)."""
    engine = Engine.from_pretrained(tiny_agent_checkpoint, EngineSettings(deterministic=True)).start()
    server = ThreadedServer(create_app(engine, model_name="tiny")).start()
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_checkpoint)
    backend = SGLangBackend(server.url, engine.vocab_size, sampling_mask_format="binary")
    store = SessionStore(
        backend, ChatRenderer(tokenizer, builtin_template()), SessionSettings(PARAMS, max_new_tokens=8)
    )
    sessions = ThreadedServer(create_sessions_app(store, model_name="tiny")).start()
    yield store, sessions.url
    sessions.stop()
    store.close()
    server.stop()
    engine.shutdown()


async def rollout(url: str, trace: str, turns: int = 2) -> list[str]:
    """What verifiers' null harness does: one X-Session-ID per rollout, streamed chat, a tool result between."""
    headers = {"X-Session-ID": trace}
    async with openai.AsyncOpenAI(base_url=url, api_key="EMPTY", max_retries=0, default_headers=headers) as client:
        messages, answers = [{"role": "user", "content": f"Rollout {trace}: what is 6 * 7?"}], []
        for k in range(turns):
            stream = await client.chat.completions.create(
                model="tiny",
                messages=messages,
                tools=TOOLS,
                max_tokens=6,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"user": "verifiers", "metadata": {"k": str(k)}},
            )
            content = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
            answers.append(content)
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": "Tool said: 42."}]
        return answers


def test_one_trajectory_per_client_id_with_no_splits(served):
    store, url = served
    traces = [f"trace-{i}" for i in range(4)]

    async def all_of_them():
        return await asyncio.gather(*(rollout(url + "/v1", t) for t in traces))

    asyncio.run(all_of_them())
    for trace in traces:
        session = store.clients.session_for(trace)
        assert session.turns == 2 and session.splits == [] and len(session.trajectories()) == 1
        assert session.metadata["client_session_id"] == trace
        (sample,) = session.to_samples(first_index=0, group=0, reward=0.0)
        mask = np.asarray(sample.loss_mask, bool)
        assert mask.any() and (~mask).any()  # the model's tokens train, the inserted tool message does not
    assert len({store.clients.session_for(t).id for t in traces}) == 4
    r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "X-Session-ID" in r.text
    sid = store.clients.session_for(traces[0]).id
    assert httpx.get(f"{url}/sessions/{sid}/v1/models").json()["data"][0]["id"] == "tiny"
    assert httpx.get(f"{url}/sessions/nope/v1/models").status_code == 404


def test_top_logprobs_inside_a_session_over_binary_masks(served):
    store, url = served
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, default_headers={"X-Session-ID": "tl"})
    reply = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=3
    )
    entries = reply.choices[0].logprobs.content
    assert entries and all(1 <= len(e.top_logprobs) <= 3 for e in entries)
    assert all(e.top_logprobs[0].logprob >= e.logprob for e in entries)
    assert store.clients.session_for("tl").failed is None


def test_a_task_scope_makes_one_group_of_client_ids(served):
    store, url = served
    scope = store.clients.open_task(2, [11, 12], metadata={"task": 7})
    base = f"{url}/tasks/{scope.id}"
    asyncio.run(rollout(base + "/v1", "a", turns=1))
    asyncio.run(rollout(base + "/v1", "b", turns=1))
    r = httpx.post(
        base + "/v1/chat/completions",
        headers={"X-Session-ID": "c"},
        json={"messages": [{"role": "user", "content": "hi"}]},
    )
    assert r.status_code == 400 and "would be sample 3 of a group of 2" in r.text
    assert httpx.get(base + "/v1/models").status_code == 200
    sessions = store.clients.close_task(scope.id)
    assert [s.metadata["client_session_id"] for s in sessions] == ["a", "b"]
    assert [s.seed for s in sessions] == [11, 12] and all(s.metadata["task"] == 7 for s in sessions)
    assert httpx.get(base + "/v1/models").status_code == 404


def test_token_turns_extend_the_trajectory_and_anything_else_is_refused(served, tiny_agent_checkpoint):
    store, url = served
    tok = AutoTokenizer.from_pretrained(tiny_agent_checkpoint)
    prompt = tok("<|im_start|>user\nAdd 3 and 4.<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    headers = {"X-Session-ID": "tokens-1"}
    sp = {"max_tokens": 5, "logprobs": 1, "skip_special_tokens": False, "stop_token_ids": [tok.eos_token_id]}
    first = httpx.post(
        url + "/inference/v1/generate", headers=headers, json={"token_ids": prompt, "sampling_params": sp}
    )
    assert first.status_code == 200, first.text
    out = first.json()["choices"][0]
    assert len(out["logprobs"]["content"]) == len(out["token_ids"]) and out["sampling_mask"] is not None
    tool = tok("\n<|im_start|>user\nThe tool said 7.<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    second = httpx.post(
        url + "/inference/v1/generate",
        headers=headers,
        json={"token_ids": prompt + out["token_ids"] + tool, "sampling_params": sp},
    )
    assert second.status_code == 200, second.text
    session = store.clients.session_for("tokens-1")
    (traj,) = session.trajectories()
    mask = np.asarray(traj.to_sample(0, 0, reward=0.0, temperature=1.0).loss_mask)
    start = len(out["token_ids"])
    assert mask[:start].all() and not mask[start : start + len(tool)].any()
    rewritten = httpx.post(
        url + "/inference/v1/generate", headers=headers, json={"token_ids": prompt + tool, "sampling_params": sp}
    )
    # a client-named conversation never splits: other tokens under its id are another conversation (issue 55, 5)
    assert rewritten.status_code == 409 and "do not extend" in rewritten.text and "never splits" in rewritten.text
    assert session.splits == [] and len(session.trajectories()) == 1
    for bad, why in [
        ({"temperature": 0.5}, "differs from the run's rollout setting"),
        ({"min_tokens": 2}, "min_tokens"),
    ]:
        r = httpx.post(
            url + "/inference/v1/generate",
            headers={"X-Session-ID": "tokens-2"},
            json={"token_ids": prompt, "sampling_params": {**sp, **bad}},
        )
        assert r.status_code == 400 and why in r.text, r.text
    chat = httpx.post(
        url + "/v1/chat/completions", headers=headers, json={"messages": [{"role": "user", "content": "x"}]}
    )
    assert chat.status_code == 400 and "a tokens session takes no chat turn" in chat.text


def test_a_session_turn_streams_as_it_is_sampled_and_records_the_same_trajectory(served):
    """Without tools a turn's text leaves token by token (through SGLang's streamed /generate to the engine); the
    deltas are the answer a whole turn gives, and the trajectory records the same tokens."""
    store, url = served
    question = [{"role": "user", "content": "Count: one two three four five six"}]
    body = {"model": "tiny", "messages": question, "max_tokens": 8, "seed": 11, "logprobs": True}
    events = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True},
                      headers={"X-Session-ID": "streamed"}, timeout=60) as reply:  # fmt: skip
        assert reply.status_code == 200
        events = [json.loads(line[6:]) for line in reply.iter_lines() if line.startswith("data: {")]
    deltas = [e["choices"][0]["delta"].get("content") for e in events if e["choices"]]
    whole = httpx.post(url + "/v1/chat/completions", json=body, headers={"X-Session-ID": "whole"}, timeout=60).json()
    assert "".join(d or "" for d in deltas) == whole["choices"][0]["message"]["content"]
    assert sum(1 for d in deltas if d) > 1  # token by token, not one chunk at the end
    assert events[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    streamed, plain = (store.get(store.clients.session_for(k, None).id) for k in ("streamed", "whole"))
    assert streamed.current.ids == plain.current.ids and streamed.turns == plain.turns == 1
    refused = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True, "messages": [{}]},
                         headers={"X-Session-ID": "streamed"}, timeout=60)  # fmt: skip
    assert refused.status_code == 400  # refused before any token: a plain HTTP error, not a 200 stream


def test_a_client_that_leaves_a_streamed_turn_drops_it_and_the_session_goes_on(served):
    store, url = served
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Write a long story"}], "max_tokens": 400}
    headers = {"X-Session-ID": "leaves"}
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, headers=headers) as reply:
        next(line for line in reply.iter_lines() if '"content"' in line)  # the first chunk, then gone
    session = store.get(store.clients.session_for("leaves", None).id)
    for _ in range(100):  # the engine drops the turn (or it had finished already)
        if not session._busy:
            break
        time.sleep(0.05)
    assert not session.failed and session.turns in (0, 1)
    again = httpx.post(url + "/v1/chat/completions", json={**body, "max_tokens": 4}, headers=headers, timeout=60)
    assert again.status_code == 200  # the session takes its next turn
