"""Real token streaming: time to the first content chunk against time to the whole answer.

    python bench/streaming.py [--model smollm2|tiny|PATH] [--tokens 64] [--runs 5]

``serve``'s app on loopback (uvicorn in a thread, the engine's loop in another), one chat request at a
time with ``stream: true`` and ``--tokens`` new tokens (EOS ignored): the seconds until the first
content delta arrives, until the last, and the same request unstreamed. Medians of ``--runs``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from engine import resolve_model  # noqa: E402
from support_replay.engine import Engine  # noqa: E402
from support_replay.serving.server import create_app  # noqa: E402
from support_replay.serving.threaded import ThreadedServer  # noqa: E402


def streamed(url: str, body: dict) -> tuple[float, float, int]:
    """(seconds to the first content delta, to the end, content deltas)."""
    start, first, deltas = time.perf_counter(), None, 0
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                deltas += 1
                first = first or time.perf_counter() - start
    return first, time.perf_counter() - start, deltas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    engine = Engine.from_pretrained(resolve_model(args.model))
    server = ThreadedServer(create_app(engine, model_name="m")).start()
    body = {
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": args.tokens,
        "ignore_eos": True,
        "top_k": 32,
        "seed": 1,
    }
    httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600)  # warm-up
    first, last, whole, deltas = [], [], [], []
    for _ in range(args.runs):
        f, t, d = streamed(server.url, body)
        first.append(f), last.append(t), deltas.append(d)
        start = time.perf_counter()
        httpx.post(server.url + "/v1/chat/completions", json=body, timeout=600)
        whole.append(time.perf_counter() - start)
    server.stop()
    engine.shutdown()
    med = statistics.median
    print(f"\n{args.tokens}-token answer, medians of {args.runs} runs\n")
    print("| first content chunk s | last chunk s | content chunks | unstreamed answer s | first chunk / whole |")
    print("|---:|---:|---:|---:|---:|")
    print(
        f"| {med(first):.3f} | {med(last):.3f} | {med(deltas):.0f} | {med(whole):.3f} | {med(first) / med(whole):.1%} |"
    )


if __name__ == "__main__":
    main()
