"""Cost of the session layer, and agent episodes per minute.

    python bench/agents.py [--model smollm2|tiny|PATH] [--sessions 1 8] [--turns 8] [--tokens 64]

1. Per-turn overhead: sessions of ``--turns`` turns x ``--tokens`` new tokens each (EOS
   ignored so every turn generates exactly that many) through the in-process session store.
   Overhead = the turn's wall time in the store minus the backend's generation time: render,
   tokenize the new text, the template and history checks, append, decode, bookkeeping.
2. The calculator environment played by its agent through the HTTP session endpoint with the
   real ``openai`` client (16 episodes), against the same episodes' model tokens generated
   single-turn: one request per episode, the episode's first prompt, as many new tokens as
   the episode's model turns had in all (the floor without multi-turn context).
3. ``--prefix``: the prefix cache. ``--prefix-episodes`` (8) concurrent episodes of ``--turns`` (8)
   turns: a 200-token system prompt shared by all, a user message of its own, then per turn 64
   generated tokens (EOS ignored) and 32 inserted tokens; each turn's prompt is the whole context
   so far. Prompt tokens computed (prefilled) and the episodes' wall time, with the prefix cache
   and without; with ``--vllm`` the same episodes through vLLM CPU 0.32's ``/v1/completions``
   (token prompts, its prefix caching on, as by default), its hit counts read from ``/metrics``.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).parent))
from engine import resolve_model  # noqa: E402
from support_replay.backends.local import EngineBackend  # noqa: E402
from support_replay.core.sampling import SamplingParams  # noqa: E402
from support_replay.engine import Engine, EngineSettings  # noqa: E402
from support_replay.protocol import GenerateRequest  # noqa: E402
from support_replay.rollout.agents import AgentRunner, load_agent  # noqa: E402
from support_replay.rollout.chat import ChatRenderer, builtin_template  # noqa: E402
from support_replay.rollout.episodes import generate_episodes  # noqa: E402
from support_replay.rollout.session import ChatTurn, SessionSettings, SessionStore  # noqa: E402
from support_replay.serving.sessions import create_sessions_app  # noqa: E402
from support_replay.serving.threaded import ThreadedServer  # noqa: E402

PARAMS = SamplingParams(temperature=1.0, top_k=32, top_p=0.8)


class TimedBackend:
    """The engine backend, EOS ignored (every turn as long as asked), generation time summed."""

    def __init__(self, backend: EngineBackend, ignore_eos: bool):
        self.backend, self.ignore_eos = backend, ignore_eos
        self.vocab_size, self.retries = backend.vocab_size, 0
        self.busy = 0.0

    def generate(self, requests, *, return_exceptions=False):
        for r in requests:
            r.ignore_eos = r.ignore_eos or self.ignore_eos
        start = time.perf_counter()
        out = self.backend.generate(requests, return_exceptions=return_exceptions)
        self.busy += time.perf_counter() - start
        return out


def overhead(engine, tokenizer, sessions: int, turns: int, tokens: int) -> dict:
    backend = TimedBackend(EngineBackend(engine), ignore_eos=True)
    settings = SessionSettings(PARAMS, max_turns=turns, max_episode_tokens=10**6, max_new_tokens=tokens)
    store = SessionStore(backend, ChatRenderer(tokenizer), settings)
    turn_walls = []

    async def one(k: int):
        s = store.create(seed=k)
        messages = [{"role": "user", "content": f"Tell me a long story about the number {k}."}]
        for t in range(turns):
            start = time.perf_counter()
            reply = await store.chat(s.id, ChatTurn(messages=messages))
            turn_walls.append(time.perf_counter() - start)
            messages += [
                {"role": "assistant", "content": reply.content},
                {"role": "user", "content": f"Go on, part {t + 2}."},
            ]
        return s

    async def all_sessions():
        return await asyncio.gather(*(one(k) for k in range(sessions)))

    start = time.perf_counter()
    done = asyncio.run(all_sessions())
    wall = time.perf_counter() - start
    # per turn: its wall time in the store, and the backend's time for it (concurrent turns overlap in both)
    per_turn_gen = backend.busy / (sessions * turns)
    per_turn_wall = float(np.mean(turn_walls))
    store.close()
    return {
        "sessions": sessions,
        "turns": turns,
        "tokens": tokens,
        "wall_s": wall,
        "turn_wall_ms": per_turn_wall * 1e3,
        "turn_generate_ms": per_turn_gen * 1e3,
        "overhead_ms": (per_turn_wall - per_turn_gen) * 1e3,
        "overhead_share": (per_turn_wall - per_turn_gen) / per_turn_gen,
        "context_tokens": float(np.mean([len(t.ids) for s in done for t in s.trajectories()])),
    }


def episodes_per_minute(engine, tokenizer, episodes: int, max_turns: int, tokens: int) -> dict:
    agent = load_agent("calculator")
    backend = TimedBackend(EngineBackend(engine), ignore_eos=False)
    settings = SessionSettings(PARAMS, max_turns=max_turns, max_episode_tokens=2048, max_new_tokens=tokens)
    store = SessionStore(backend, ChatRenderer(tokenizer, builtin_template()), settings)
    server = ThreadedServer(create_sessions_app(store)).start()
    runner = AgentRunner(agent, store, server.url, reward_fn=None, timeout=3600)
    tasks = agent.tasks(0)
    prompts = [tasks[i] for i in range(episodes // 4)]
    start = time.perf_counter()
    samples, _ = generate_episodes(runner, prompts, n_samples=4, settings=settings, rollout=0, seed=0)
    ours = time.perf_counter() - start
    server.stop()
    store.close()
    # the floor: each episode's model tokens as one single-turn request from its first prompt
    renderer = ChatRenderer(tokenizer, builtin_template())
    from support_replay.rollout.environments.calculator import TOOLS

    requests = []
    for i, s in enumerate(samples):
        if s.metadata.get("segment", 0):
            continue
        p = prompts[s.group]
        ids = renderer.encode(renderer.render(p.content, TOOLS, generation_prompt=True))
        model_tokens = int(s.loss_mask.sum())
        requests.append(
            GenerateRequest(
                ids,
                SamplingParams(seed=i, **{k: getattr(PARAMS, k) for k in ("temperature", "top_k", "top_p")}),
                max_new_tokens=max(model_tokens, 1),
                ignore_eos=True,
                return_sampling_mask=True,
            )
        )
    start = time.perf_counter()
    engine.generate(requests)
    floor = time.perf_counter() - start
    turns = [s.metadata["turns"] for s in samples if not s.metadata.get("segment", 0)]
    return {
        "episodes": len(requests),
        "turns_mean": float(np.mean(turns)),
        "tool_calls": sum(t > 1 for t in turns),
        "model_tokens": int(sum(s.loss_mask.sum() for s in samples)),
        "inserted_tokens": int(sum((s.loss_mask == 0).sum() for s in samples)),
        "ours_s": ours,
        "ours_per_min": len(requests) / ours * 60,
        "single_turn_s": floor,
        "single_turn_per_min": len(requests) / floor * 60,
    }


SYSTEM_TOKENS, INSERTED_TOKENS = 200, 32


def episode_prompts(tokenizer, episodes: int) -> tuple[list[list[int]], list[int]]:
    """Each episode's first prompt (the shared 200-token system prompt, then its own question) and the
    32 tokens inserted after every model turn."""
    words = " ".join(f"Rule {i}: answer in full sentences and check every step." for i in range(60))
    system = tokenizer(words, add_special_tokens=False)["input_ids"][:SYSTEM_TOKENS]
    tool = tokenizer(" Tool result: " + "the value is 42, " * 20, add_special_tokens=False)["input_ids"]
    firsts = [
        system + tokenizer(f" Question {i}: what is {i} times 7?", add_special_tokens=False)["input_ids"]
        for i in range(episodes)
    ]
    return firsts, tool[:INSERTED_TOKENS]


def play_rounds(generate, firsts: list[list[int]], inserted: list[int], turns: int, tokens: int) -> float:
    """Every episode's turns, the episodes' k-th turns sent together; ``generate(prompts) -> outputs``."""
    contexts = [list(p) for p in firsts]
    start = time.perf_counter()
    for k in range(turns):
        outputs = generate(contexts, tokens)
        contexts = [c + out + (inserted if k < turns - 1 else []) for c, out in zip(contexts, outputs)]
    return time.perf_counter() - start


def ours_rounds(path, firsts, inserted, turns: int, tokens: int, cache: bool) -> dict:
    engine = Engine.from_pretrained(path, EngineSettings(prefix_cache=cache)).start()

    def generate(prompts, n):
        reqs = [
            GenerateRequest(p, PARAMS, max_new_tokens=n, ignore_eos=True, return_sampling_mask=True) for p in prompts
        ]
        return [c.output_ids for c in engine.generate(reqs)]

    play_rounds(generate, [f[:40] for f in firsts[:2]], inserted, 2, 4)  # warm-up, other prompts
    engine.prefix_cache.clear()
    before = engine.prefix_cache.stats.prefilled_tokens
    seconds = play_rounds(generate, firsts, inserted, turns, tokens)
    prefilled = engine.prefix_cache.stats.prefilled_tokens - before
    engine.shutdown()
    return {"seconds": seconds, "prefilled": prefilled}


def vllm_rounds(path, firsts, inserted, turns: int, tokens: int) -> dict:
    import os
    import re
    import subprocess
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from processes import free_port
    from support_replay.launch import wait_healthy

    python = Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(path), "--served-model-name", "m",
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32", "--max-model-len", "2048",
        "--gpu-memory-utilization", "0.2", "--enable-prefix-caching",
    ]  # fmt: skip
    log = Path(tempfile.mkdtemp()) / "vllm.log"
    proc = subprocess.Popen(args, stdout=log.open("w"), stderr=subprocess.STDOUT, env=dict(os.environ))
    try:
        wait_healthy(url, proc, 600, log)
        client = httpx.Client(timeout=600)
        pool = ThreadPoolExecutor(len(firsts))

        def one(prompt, n):
            body = {"model": "m", "prompt": prompt, "max_tokens": n, "ignore_eos": True, "top_k": 32, "top_p": 0.8}
            body |= {"return_token_ids": True}
            return client.post(url + "/v1/completions", json=body).json()["choices"][0]["token_ids"]

        def generate(prompts, n):
            return list(pool.map(lambda p: one(p, n), prompts))

        def counters():
            text = client.get(url + "/metrics").text
            found = {}
            for name in ("prefix_cache_queries", "prefix_cache_hits"):
                m = re.search(rf"^vllm:{name}_total{{[^}}]*}} ([0-9.e+]+)$", text, re.M)
                found[name] = float(m.group(1)) if m else float("nan")
            return found

        play_rounds(generate, [f[:40] for f in firsts[:2]], inserted, 2, 4)
        before = counters()
        seconds = play_rounds(generate, firsts, inserted, turns, tokens)
        after = counters()
        queried = after["prefix_cache_queries"] - before["prefix_cache_queries"]
        hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
        return {"seconds": seconds, "prefilled": queried - hits, "queried": queried}
    finally:
        proc.terminate()
        proc.wait(60)


def prefix_reuse(path, tokenizer, episodes: int, turns: int, tokens: int, vllm: bool) -> None:
    firsts, inserted = episode_prompts(tokenizer, episodes)
    total = sum(
        len(f) + k * (tokens + INSERTED_TOKENS) for f in firsts for k in range(turns)
    )  # every turn's whole prompt
    print(
        f"\n{episodes} concurrent episodes x {turns} turns: {SYSTEM_TOKENS}-token shared system prompt, {tokens} "
        f"generated + {INSERTED_TOKENS} inserted tokens per turn; {total} prompt tokens in all\n"
    )
    print("| engine | prompt tokens prefilled | fewer than every whole prompt | episodes wall s |")
    print("|---|---:|---:|---:|")
    runs = [
        ("ours, prefix cache off", lambda: ours_rounds(path, firsts, inserted, turns, tokens, False)),
        ("ours, prefix cache on", lambda: ours_rounds(path, firsts, inserted, turns, tokens, True)),
    ]
    if vllm:
        runs.append(("vLLM CPU 0.32, prefix caching on", lambda: vllm_rounds(path, firsts, inserted, turns, tokens)))
    for name, run in runs:
        r = run()
        print(f"| {name} | {r['prefilled']:.0f} | {1 - r['prefilled'] / total:.1%} | {r['seconds']:.1f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--episode-turns", type=int, default=4)
    parser.add_argument("--prefix", action="store_true", help="only section 3, the prefix cache")
    parser.add_argument("--prefix-episodes", type=int, default=8)
    parser.add_argument("--vllm", action="store_true", help="with section 3: the vLLM CPU anchor (.venv-vllm)")
    args = parser.parse_args()
    path = resolve_model(args.model)
    if args.prefix:
        prefix_reuse(
            path, AutoTokenizer.from_pretrained(path), args.prefix_episodes, args.turns, args.tokens, args.vllm
        )
        return
    engine = Engine.from_pretrained(path).start()
    tokenizer = AutoTokenizer.from_pretrained(path)
    print(f"model {path.name}, {args.turns} turns x {args.tokens} tokens per session\n")
    print("| sessions | turn wall ms | of which generation ms | session layer ms | share | mean context tokens |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n in args.sessions:
        r = overhead(engine, tokenizer, n, args.turns, args.tokens)
        print(
            f"| {n} | {r['turn_wall_ms']:.1f} | {r['turn_generate_ms']:.1f} | {r['overhead_ms']:.2f} | "
            f"{r['overhead_share']:.2%} | {r['context_tokens']:.0f} |"
        )
    r = episodes_per_minute(engine, tokenizer, args.episodes, args.episode_turns, args.tokens)
    print(
        f"\ncalculator environment, {r['episodes']} episodes (4 per task), up to {args.episode_turns} turns x "
        f"{args.tokens} tokens, "
        f"mean {r['turns_mean']:.2f} turns, {r['tool_calls']} episodes with a tool call, {r['model_tokens']} model / "
        f"{r['inserted_tokens']} inserted tokens\n"
    )
    print("| path | seconds | episodes per minute |")
    print("|---|---:|---:|")
    print(f"| sessions over HTTP, openai client, the agent's turns | {r['ours_s']:.1f} | {r['ours_per_min']:.1f} |")
    print(
        f"| same model tokens single-turn (one request per episode) | {r['single_turn_s']:.1f} | "
        f"{r['single_turn_per_min']:.1f} |"
    )
    engine.shutdown()


if __name__ == "__main__":
    main()
