"""Hostile clients against one engine (docs/reliability.md, round three), on the tiny test model so the
server, not the model, is measured. For each attack: ``/health`` every 50 ms and a well-behaved client
(``/generate``, 2 tokens, one after another) each from a process of its own, during the attack; their p50 and
p99, and what the attack's requests got.

- capture (finding 2): 4 clients sending, one after another, the 192-byte body that asks for 8 x 1,000 tokens'
  top-384 supports with their log-probs as JSON.
- grammar (finding 3): 2 clients sending a 390 KB JSON schema with ``n: 16``, each body a new schema
  (one property renamed: no cache helps).
- text (finding 4): 2 clients sending a 7 MB chat message.
- slow connections (finding 7): half a request's headers on ever more connections from 127.0.0.1 (the
  engine's open-file limit set to 4,096); at each count the well-behaved client's worst ``/health`` of 5, from
  127.0.0.1 and from 127.0.0.2.

    python bench/hostile_clients.py [--seconds 20] [--label now]

The code before the fixes is measured by pointing ``PYTHONPATH`` at its ``src`` (the engine process inherits it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from processes import engine_process  # noqa: E402
from tiny_model import build_tiny_checkpoint  # noqa: E402

CAPTURE = {
    "prompt": "hi", "n": 8, "max_tokens": 1000, "ignore_eos": True, "temperature": 50, "top_k": 384,
    "return_sampling_mask": True, "return_meta_info": True, "sampling_logprobs_mode": "support",
}  # fmt: skip

PROBE = """
import json, os, sys, time, httpx
url, stop_file, kind, lat = sys.argv[1], sys.argv[2], sys.argv[3], []
body = {"text": "hi", "sampling_params": {"max_new_tokens": 2, "temperature": 1.0, "top_k": 8}}
with httpx.Client(timeout=120) as client:
    while not os.path.exists(stop_file):
        start = time.perf_counter()
        r = client.get(url + "/health") if kind == "health" else client.post(url + "/generate", json=body)
        lat.append(time.perf_counter() - start); time.sleep(0.05)
print(json.dumps(lat))
"""


def schema(variant: int, pairs: int = 200) -> dict:
    def obj(i, j):
        props = {f"p{i}_{j}_{k}": {"type": "string"} for k in range(30)}
        if i == 0 and j == 0:
            props[f"v{variant}"] = {"type": "string"}
        return {"type": "object", "properties": props, "required": [f"p{i}_{j}_0"]}

    return {"anyOf": [{"allOf": [obj(i, 0), obj(i, 1)]} for i in range(pairs)]}


def grammar_body(variant: int) -> dict:
    form = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema(variant)}}
    return {"messages": [{"role": "user", "content": "x"}], "n": 16, "max_tokens": 2, "top_k": 20,
            "response_format": form}  # fmt: skip


TEXT = {"messages": [{"role": "user", "content": "word " * 1_400_000}], "max_tokens": 2}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))] * 1000


async def attack(url: str, clients: int, seconds: float, make) -> Counter:
    """``clients`` loops, each sending ``make(i)`` (path, body) one after another for ``seconds``."""
    outcomes: Counter = Counter()
    deadline = time.monotonic() + seconds
    counter = iter(range(10**9))

    async def loop(client):
        while time.monotonic() < deadline:
            path, body = make(next(counter))
            try:
                r = await client.post(url + path, json=body)
                outcomes[f"{r.status_code}, {len(r.content) / 2**20:.1f} MiB" if r.status_code == 200 else
                         str(r.status_code)] += 1  # fmt: skip
            except httpx.HTTPError as exc:
                outcomes[type(exc).__name__] += 1

    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*(loop(client) for _ in range(clients)))
    return outcomes


def during(url: str, work) -> tuple[dict, dict]:
    """Run ``work()`` with the two probes going; returns (latencies by probe, work's result)."""
    folder = Path(tempfile.mkdtemp())
    stop = folder / "stop"
    probes = {
        kind: subprocess.Popen([sys.executable, "-c", PROBE, url, str(stop), kind], stdout=subprocess.PIPE, text=True)
        for kind in ("health", "client")
    }
    time.sleep(1.0)
    result = work()
    stop.touch()
    return {kind: json.loads(p.communicate()[0] or "[]") for kind, p in probes.items()}, result


async def slow_connections(url: str, counts: list[int]) -> list[tuple[int, int, str, str]]:
    """Open ever more connections that send half their headers; at each count, the well-behaved client's worst
    /health of 5 from 127.0.0.1 and from 127.0.0.2."""
    host, port = url.removeprefix("http://").split(":")
    held, rows = [], []

    async def worst(source: str) -> str:
        times, statuses = [], Counter()
        transport = httpx.AsyncHTTPTransport(local_address=source)
        async with httpx.AsyncClient(transport=transport, timeout=5) as client:
            for _ in range(5):
                start = time.perf_counter()
                try:
                    statuses[(await client.get(url + "/health")).status_code] += 1
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1
                times.append(time.perf_counter() - start)
        return f"{max(times) * 1000:.0f} ms ({', '.join(f'{k} x{v}' for k, v in statuses.items())})"

    for count in counts:
        while len(held) < count:
            try:
                reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 5)
                writer.write(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\n")
                held.append((asyncio.ensure_future(reader.read()), writer))  # done once the server closes it
            except (OSError, asyncio.TimeoutError):
                break
        await asyncio.sleep(0.5)
        alive = sum(not closed.done() for closed, _ in held)
        rows.append((count, alive, await worst("127.0.0.1"), await worst("127.0.0.2")))
    for closed, w in held:
        closed.cancel()
        w.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--label", default="now")
    args = parser.parse_args()
    checkpoint = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny", max_positions=2048)

    print(f"## {args.label}\n")
    print("| attack | what the attack got | /health p50 ms | /health p99 ms | client p50 ms | client p99 ms |")
    print("|---|---|---:|---:|---:|---:|")
    attacks = {
        "none (baseline)": (0, None),
        "capture: 8 x 1,000 tokens of top-384 supports as JSON, 4 clients": (4, lambda i: ("/v1/completions", CAPTURE)),
        "grammar: a new 390 KB schema with n 16, 2 clients": (2, lambda i: ("/v1/chat/completions", grammar_body(i))),
        "text: a 7 MB chat message, 2 clients": (2, lambda i: ("/v1/chat/completions", TEXT)),
    }
    ctx, url = engine_process(checkpoint)
    with ctx:
        for name, (clients, make) in attacks.items():
            if make is None:
                lat, got = during(url, lambda: time.sleep(args.seconds) or Counter())
            else:
                lat, got = during(url, lambda: asyncio.run(attack(url, clients, args.seconds, make)))
            h, c = lat["health"], lat["client"]
            what = "; ".join(f"{k}: {v}" for k, v in sorted(got.items())) or "-"
            print(
                f"| {name} | {what} | {pct(h, 0.5):.1f} | {pct(h, 0.99):.1f} | {pct(c, 0.5):.1f} | {pct(c, 0.99):.1f} |"
            )

    # the engine's open-file limit at 4,096 (inherited), this process's back up for the connections it opens
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))
    ctx, url = engine_process(checkpoint)
    with ctx:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        rows = asyncio.run(slow_connections(url, [256, 1024, 2048, 3584, 4096, 6144]))
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    print("\n| slow connections opened | still open after 0.5 s | /health from 127.0.0.1, worst of 5 | "
          "/health from 127.0.0.2, worst of 5 |")  # fmt: skip
    print("|---:|---:|---|---|")
    for count, alive, same, other in rows:
        print(f"| {count:,} | {alive:,} | {same} | {other} |")


if __name__ == "__main__":
    main()
