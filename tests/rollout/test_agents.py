"""The session endpoint over HTTP with the real ``openai`` client and the tiny engine: streamed
and whole answers give the same trajectory, 64 sessions at once do not mix, the OpenAI
shapes (tool calls, logprobs, replay metadata) are what clients read."""

import asyncio

import httpx
import numpy as np
import openai
import pytest
from transformers import AutoTokenizer

from support_replay.backends.local import EngineBackend
from support_replay.core.sampling import SamplingParams
from support_replay.engine import Engine, EngineSettings
from support_replay.rollout.chat import ChatRenderer, builtin_template
from support_replay.rollout.session import SessionSettings, SessionStore
from support_replay.serving.sessions import create_sessions_app
from support_replay.serving.threaded import ThreadedServer

PARAMS = SamplingParams(temperature=1.0, top_k=32, top_p=0.8)


@pytest.fixture(scope="module")
def served(tiny_agent_checkpoint):
    """A deterministic engine (answers do not depend on what else is in the batch) behind a
    session store, served on loopback."""
    engine = Engine.from_pretrained(tiny_agent_checkpoint, EngineSettings(deterministic=True))
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_checkpoint)
    store = SessionStore(
        EngineBackend(engine), ChatRenderer(tokenizer, builtin_template()), SessionSettings(PARAMS, max_new_tokens=8)
    )
    server = ThreadedServer(create_sessions_app(store)).start()
    yield store, server.url
    server.stop()
    store.close()
    engine.shutdown()


def new_session(url: str, seed: int) -> str:
    r = httpx.post(url + "/sessions", json={"seed": seed})
    assert r.status_code == 200, r.text
    return r.json()["session_id"]


async def dialogue(url: str, sid: str, turns: int, stream: bool) -> list[str]:
    """A plain multi-turn client: each answer goes back into the history, then a user message."""
    async with openai.AsyncOpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="x", max_retries=0) as client:
        messages, answers = [{"role": "user", "content": "Start from 3. Add 4."}], []
        for k in range(turns):
            if stream:
                chunks = await client.chat.completions.create(model="m", messages=messages, stream=True)
                content = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            else:
                reply = await client.chat.completions.create(model="m", messages=messages)
                content = reply.choices[0].message.content
            answers.append(content)
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"Step {k}: add 2."}]
        return answers


def trajectory(url: str, sid: str) -> dict:
    r = httpx.get(f"{url}/sessions/{sid}/trajectory")
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.float_bits
def test_streamed_and_whole_answers_give_the_identical_sample(served):
    _, url = served
    a, b = new_session(url, 11), new_session(url, 11)
    assert asyncio.run(dialogue(url, a, 3, stream=False)) == asyncio.run(dialogue(url, b, 3, stream=True))
    ta, tb = trajectory(url, a), trajectory(url, b)
    assert ta["samples"] == tb["samples"] and len(ta["samples"]) == 1
    sample = ta["samples"][0]
    mask = np.array(sample["loss_mask"], bool)
    assert sample["model_turns"] == 3 and (~mask).sum() > 0
    assert all(
        sample["log_mu"][t] == 0.0 and sample["support"][t] == [sample["response_ids"][t]]
        for t in np.flatnonzero(~mask)
    )


def test_64_concurrent_sessions_equal_their_sequential_replays(served):
    _, url = served

    async def many(seeds):
        sids = [new_session(url, s) for s in seeds]
        await asyncio.gather(*(dialogue(url, sid, 3, stream=False) for sid in sids))
        return [trajectory(url, sid)["samples"] for sid in sids]

    seeds = list(range(100, 164))
    together = asyncio.run(many(seeds))
    for seed, samples in zip(seeds[::9], together[::9]):  # every ninth replayed alone, one turn at a time
        alone = asyncio.run(many([seed]))[0]
        assert alone == samples, f"session with seed {seed} differs from its sequential replay"
    prompts = {tuple(s[0]["response_ids"]) for s in together}
    assert len(prompts) == 64  # different seeds, different trajectories: nothing shared by accident


def test_openai_shapes_tool_calls_logprobs_and_replay_metadata(served):
    store, url = served
    sid = new_session(url, 5)
    client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="x", max_retries=0)
    tools = [
        {"type": "function", "function": {"name": "calculator", "parameters": {"type": "object", "properties": {}}}}
    ]
    reply = client.chat.completions.create(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        tools=tools,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_meta_info": True},
    )
    choice = reply.choices[0]
    meta = choice.model_extra["meta_info"]
    assert len(choice.logprobs.content) == len(meta["output_ids"]) == reply.usage.completion_tokens
    for entry, lp, row in zip(
        choice.logprobs.content, meta["output_token_sampling_logprobs"], meta["output_token_sampling_mask"]
    ):
        assert entry.logprob == lp and len(entry.top_logprobs) == min(3, len(row))
        assert entry.top_logprobs[0].logprob >= entry.logprob  # the support's most likely id first
    assert meta["turn"] == 0 and meta["weight_versions"][0]["version"] == "default"
    for bad, why in [
        ({"n": 2}, "n=2: a session is one trajectory"),
        ({"temperature": 0.5}, "differs from the run's rollout setting"),
        ({"presence_penalty": 0.5}, "presence_penalty=0.5 differs from the run's rollout setting 0.0"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}, "tools": tools}, "'nope' is not among"),
    ]:
        with pytest.raises(openai.BadRequestError, match=why):
            client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], **bad)
    with pytest.raises(openai.NotFoundError, match="no such session"):
        openai.OpenAI(base_url=f"{url}/sessions/nope/v1", api_key="x", max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}]
        )
    assert httpx.post(f"{url}/sessions/{sid}/finish", json={"reward": 1.5}).json()["finished"] is True
    assert trajectory(url, sid)["reward"] == 1.5
    assert (
        httpx.delete(f"{url}/sessions/{sid}").status_code == 200
        and httpx.get(f"{url}/sessions/{sid}").status_code == 404
    )


def test_abandoned_sessions_expire(served):
    store, url = served
    sid = new_session(url, 1)
    store.get(sid).last_used -= store.settings.ttl + 1
    assert store.expire() >= 1 and httpx.get(f"{url}/sessions/{sid}").status_code == 404
