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
from support_replay.engine import Engine  # noqa: E402
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--episode-turns", type=int, default=4)
    args = parser.parse_args()
    path = resolve_model(args.model)
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
