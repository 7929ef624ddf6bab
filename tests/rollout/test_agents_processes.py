"""Agents through real processes: GRPO with --ci-test through `support-replay serve` engines
behind our router over HTTP, every turn of a session on one engine, and a session whose engine
dies failing that episode cleanly."""

import asyncio
import signal
import sys

import httpx
import pytest
from transformers import AutoTokenizer

from processes import engine_processes, router_process
from recipe_helpers import agent_config
from support_replay.backends.sglang import SGLangBackend
from support_replay.core.sampling import SamplingParams
from support_replay.errors import SessionFailed
from support_replay.rollout.chat import ChatRenderer
from support_replay.rollout.session import ChatTurn, SessionSettings, SessionStore
from support_replay.train import train

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def two_engines_and_router(tiny_agent_checkpoint):
    with engine_processes(tiny_agent_checkpoint, 2) as [(proc_a, url_a), (proc_b, url_b)]:
        ctx, router_url = router_process([url_a, url_b])
        with ctx:
            yield router_url, {url_a: proc_a, url_b: proc_b}


def served_counts(router_url: str) -> dict:
    return {w["url"]: w["served"] for w in httpx.get(router_url + "/workers").json()}


@pytest.mark.parametrize("agent", ["chain", "calculator"])
def test_grpo_on_agents_through_serve_and_the_router(two_engines_and_router, tiny_agent_checkpoint, tmp_path, agent):
    router_url, _ = two_engines_and_router
    rows = train(agent_config(tiny_agent_checkpoint, tmp_path, agent=agent, rollout_url=router_url))
    assert len(rows) == 2
    for r in rows:
        assert r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and r["failed_samples"] == 0 and r["policy_lag_max"] == 0
        assert r["support_bytes_per_token"] > 0  # the support crossed the wire, in the binary form
    if agent == "chain":
        assert rows[0]["episode_turns_mean"] > 1


def test_the_sessions_command_in_front_of_the_router(two_engines_and_router, tiny_agent_checkpoint, tmp_path):
    import openai

    from processes import free_port, process

    router_url, _ = two_engines_and_router
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    key = tmp_path / "key"
    key.write_text("sekrit\n")
    args = [
        sys.executable,
        "-m",
        "support_replay.cli",
        "sessions",
        "--backend",
        router_url,
        "--tokenizer",
        str(tiny_agent_checkpoint),
        "--port",
        str(port),
        "--max-new-tokens",
        "6",
        "--api-key-file",
        str(key),
        "--repetition-penalty",
        "1.2",
    ]
    with process(args, url):
        assert httpx.post(url + "/sessions", json={}).status_code == 401
        sid = httpx.post(url + "/sessions", json={"seed": 4}, headers={"Authorization": "Bearer sekrit"}).json()[
            "session_id"
        ]
        client = openai.OpenAI(base_url=f"{url}/sessions/{sid}/v1", api_key="sekrit", max_retries=0)
        messages = [{"role": "user", "content": "Start from 3."}]
        for k in range(2):
            reply = client.chat.completions.create(model="m", messages=messages)
            messages += [
                {"role": "assistant", "content": reply.choices[0].message.content},
                {"role": "user", "content": "Add 1."},
            ]
        [sample] = httpx.get(f"{url}/sessions/{sid}/trajectory", headers={"Authorization": "Bearer sekrit"}).json()[
            "samples"
        ]
    assert (
        sample["model_turns"] == 2
        and 0 in sample["loss_mask"]
        and len(sample["support"]) == len(sample["response_ids"])
    )
    assert (
        sample["penalties"]["repetition_penalty"] == 1.2 and len(sample["output_starts"]) == 2
    )  # what a trainer needs to replay them


def test_every_turn_of_a_session_goes_to_one_engine_and_a_dead_engine_fails_the_episode(
    two_engines_and_router, tiny_agent_checkpoint
):
    # the last test of the module: it kills one of the module's engines
    router_url, procs = two_engines_and_router
    tokenizer = AutoTokenizer.from_pretrained(tiny_agent_checkpoint)
    backend = SGLangBackend(router_url, len(tokenizer), timeout=30)
    store = SessionStore(
        backend,
        ChatRenderer(tokenizer),
        SessionSettings(SamplingParams(temperature=1.0, top_k=32, top_p=0.8), max_new_tokens=6),
    )

    def play(sid, turns):
        messages = [{"role": "user", "content": "Start from 3."}]
        for k in range(turns):
            reply = asyncio.run(store.chat(sid, ChatTurn(messages=messages)))
            messages += [{"role": "assistant", "content": reply.content}, {"role": "user", "content": f"Add {k}."}]
        return messages

    for _ in range(4):  # one session at a time: each engine's count grows by whole sessions
        before = served_counts(router_url)
        play(store.create().id, 3)
        grown = [served_counts(router_url)[u] - before[u] for u in before]
        assert sorted(grown) == [0, 3], grown
    sid = store.create().id
    before = served_counts(router_url)
    messages = play(sid, 1)
    [home] = [u for u, n in served_counts(router_url).items() if n > before[u]]
    procs[home].send_signal(signal.SIGKILL)
    procs[home].wait()
    with pytest.raises(SessionFailed, match="turn 1: the engine failed the turn; the episode ends"):
        asyncio.run(store.chat(sid, ChatTurn(messages=messages)))
    assert store.get(sid).failed and len(store.get(sid).trajectories()) == 1  # never moved, never half-extended
    store.close()
