"""Load (docs/reliability.md), on the tiny test model so the machinery, not the model, is measured.

1. One deterministic engine, queue 256, batch 64: 1,000 requests at once. Clients honour
   Retry-After on a 503 (up to 5 tries). Reports the statuses, the /health latency (p50/p99)
   during the run (from a process of its own, every 50 ms), the engine's resident memory before and after,
   and whether every 200 answer
   is bit-identical to the same request sent alone afterwards.
2. Our router over three engines: 5,000 requests, 256 at a time; the share each engine served.

    python bench/load.py [--requests 1000] [--router-requests 5000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from processes import engine_process, router_process  # noqa: E402
from tiny_model import build_tiny_checkpoint  # noqa: E402


def body(i: int) -> dict:
    return {
        "input_ids": [5 + i % 11, 40, 77, 9 + i % 97],
        "rid": f"load-{i}",
        "return_sampling_mask": True,
        "sampling_params": {
            "temperature": 1.0,
            "top_k": 16,
            "top_p": 0.9,
            "max_new_tokens": 8,
            "ignore_eos": True,
            "sampling_seed": i,
        },
    }


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


async def ask(client, url, i, tries=5):
    for _ in range(tries):
        r = await client.post(url + "/generate", json=body(i))
        if r.status_code != 503:
            return r.status_code, r.json() if r.status_code == 200 else None
        await asyncio.sleep(float(r.headers.get("retry-after", "1")))
    return 503, None


PROBE = """
import json, sys, time, httpx
url, stop_file, lat = sys.argv[1], sys.argv[2], []
with httpx.Client() as client:
    while not __import__("os").path.exists(stop_file):
        start = time.perf_counter(); client.get(url + "/health", timeout=60)
        lat.append(time.perf_counter() - start); time.sleep(0.05)
print(json.dumps(lat))
"""


def health_probe(url: str, stop_file: Path) -> subprocess.Popen:
    """/health every 50 ms from a process of its own: measured from the load client's event loop, the
    latency would be that loop's (1,000 requests in flight), not the server's."""
    return subprocess.Popen([sys.executable, "-c", PROBE, url, str(stop_file)], stdout=subprocess.PIPE, text=True)


async def one_engine(url: str, n: int) -> tuple[Counter, list, dict]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        stop_file = Path(tempfile.mkdtemp()) / "stop"
        probe = health_probe(url, stop_file)
        start = time.perf_counter()
        answers = await asyncio.gather(*(ask(client, url, i) for i in range(n)))
        elapsed = time.perf_counter() - start
        stop_file.touch()
        latencies = json.loads(probe.communicate()[0])
        statuses = Counter(status for status, _ in answers)
        # every 200 answer against the same request sent alone (new rid: no cached answer)
        same = 0
        for i, (status, answer) in enumerate(answers):
            if status == 200:
                alone = (await client.post(url + "/generate", json={**body(i), "rid": f"alone-{i}"})).json()
                same += (
                    alone["output_ids"] == answer["output_ids"]
                    and alone["meta_info"]["output_token_sampling_logprobs"]
                    == answer["meta_info"]["output_token_sampling_logprobs"]
                )
    return statuses, sorted(latencies), {"elapsed_s": elapsed, "bit_identical": same}


async def through_router(url: str, n: int, concurrency: int = 256) -> Counter:
    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(i):
            async with gate:
                return (await client.post(url + "/generate", json={**body(i), "rid": f"router-{i}"})).status_code

        return Counter(await asyncio.gather(*(one(i) for i in range(n))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--router-requests", type=int, default=5000)
    args = ap.parse_args()
    checkpoint = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")

    ctx, url = engine_process(checkpoint, "--deterministic", "--max-queue", "256", "--max-batch-size", "64")
    with ctx as proc:
        before = rss_kb(proc.pid)
        statuses, latencies, extra = asyncio.run(one_engine(url, args.requests))
        after = rss_kb(proc.pid)
    ok = statuses.get(200, 0)
    print(f"\n{args.requests:,} at once against one engine (queue 256, batch 64), {extra['elapsed_s']:.1f} s:")
    print(
        "| answered 200 | 503 after 5 tries | other | /health p50 ms | /health p99 ms | RSS before MB | RSS after MB "
        "| 200s bit-identical alone |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    other = sum(v for k, v in statuses.items() if k not in (200, 503))
    p = lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000  # noqa: E731
    print(
        f"| {ok} ({ok / args.requests:.0%}) | {statuses.get(503, 0)} | {other} | {p(0.5):.1f} | {p(0.99):.1f} | "
        f"{before / 1024:.0f} | {after / 1024:.0f} | {extra['bit_identical']} of {ok} |"
    )

    engines = [engine_process(checkpoint) for _ in range(3)]
    with engines[0][0], engines[1][0], engines[2][0]:
        rctx, rurl = router_process([u for _, u in engines])
        with rctx:
            start = time.perf_counter()
            statuses = asyncio.run(through_router(rurl, args.router_requests))
            elapsed = time.perf_counter() - start
            served = {w["url"]: w["served"] for w in httpx.get(rurl + "/workers").json()}
    total = sum(served.values())
    print(
        f"\n{args.router_requests:,} requests through our router over three engines, {elapsed:.1f} s, statuses "
        f"{dict(statuses)}:"
    )
    print("| engine | served | share |")
    print("|---|---:|---:|")
    for u, n in served.items():
        print(f"| {u} | {n} | {n / total:.1%} |")


if __name__ == "__main__":
    main()
