"""Faults (docs/reliability.md), on the tiny test model.

1. Engines killed under load: our router over three engines, one engine SIGKILLed every
   ``--kill-every`` seconds for ``--minutes`` (and started again on its port), clients sending
   without pause. Every request has its own rid and seed and is sent again (same rid) when no
   answer came; reports requests sent, answered, lost, answered twice, and the slowest answer.
2. The trainer killed at ``--trainer-kills`` random moments (mid-checkpoint included), each time
   resumed to the end, in true-on-policy mode: are the final weights bitwise those of a run
   that was never interrupted?
3. A chunked 64 MiB body: the status and the server's memory growth.

    python bench/faults.py [--minutes 5] [--kill-every 30] [--trainer-kills 20]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from processes import engine_process, free_port, router_process, wait_healthy  # noqa: E402
from tiny_model import build_tiny_checkpoint  # noqa: E402


def serve_on(checkpoint: Path, port: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "support_replay.cli", "serve", "--hf-checkpoint", str(checkpoint), "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def engines_killed_under_load(checkpoint: Path, minutes: float, kill_every: float, workers: int = 24) -> dict:
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [serve_on(checkpoint, p) for p in ports]
    for u, p in zip(urls, procs):
        wait_healthy(u, p)
    rctx, rurl = router_process(urls, health_interval=1.0)
    stats, answers, slowest = Counter(), Counter(), [0.0]
    stop = threading.Event()
    lock = threading.Lock()

    def client(worker: int):
        http = httpx.Client(timeout=60)
        n = 0
        while not stop.is_set():
            rid = f"w{worker}-{n}"
            body = {
                "input_ids": [5 + n % 11, 40, 77],
                "rid": rid,
                "sampling_params": {
                    "top_k": 16,
                    "max_new_tokens": 8,
                    "ignore_eos": True,
                    "sampling_seed": worker * 10**6 + n,
                },
            }
            start = time.perf_counter()
            for _ in range(20):  # the same rid again until it is answered
                try:
                    r = http.post(rurl + "/generate", json=body)
                    if r.status_code == 200:
                        with lock:
                            answers[rid] += 1
                        break
                except httpx.HTTPError:
                    pass
                with lock:
                    stats["sent again"] += 1
                time.sleep(0.5)
            with lock:
                stats["requests"] += 1
                slowest[0] = max(slowest[0], time.perf_counter() - start)
            n += 1

    with rctx:
        with ThreadPoolExecutor(workers) as pool:
            for w in range(workers):
                pool.submit(client, w)
            deadline, victim = time.monotonic() + minutes * 60, 0
            while time.monotonic() < deadline:
                time.sleep(kill_every)
                procs[victim].send_signal(signal.SIGKILL)
                procs[victim].wait()
                stats["kills"] += 1
                time.sleep(2)
                procs[victim] = serve_on(checkpoint, ports[victim])
                wait_healthy(urls[victim], procs[victim])
                victim = (victim + 1) % 3
            stop.set()
        router = httpx.get(rurl + "/metrics").text
    for p in procs:
        p.terminate()
    lost = stats["requests"] - len(answers)
    return {
        **stats,
        "answered": len(answers),
        "lost": lost,
        "answered twice": sum(1 for v in answers.values() if v > 1),
        "slowest_s": round(slowest[0], 1),
        "router_retries": next(
            (
                line.split()[-1]
                for line in router.splitlines()
                if line.startswith("support_replay_router_retries_total")
            ),
            "?",
        ),
    }


def train_args(checkpoint: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "support_replay.cli",
        "train",
        "--hf-checkpoint",
        str(checkpoint),
        "--num-rollout",
        "6",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--global-batch-size",
        "8",
        "--rollout-max-response-len",
        "8",
        "--lr",
        "1e-3",
        "--custom-rm-path",
        "rewards_for_tests:digit_share",
        "--true-on-policy-mode",
        "--ci-test",
        "--output-dir",
        str(out / "out"),
        "--save",
        str(out / "ckpt"),
        "--save-interval",
        "1",
        "--no-progress",
    ]


def trainer_killed(checkpoint: Path, kills: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "tests")}
    work = Path(tempfile.mkdtemp(prefix="faults-"))
    start = time.perf_counter()
    subprocess.run(train_args(checkpoint, work / "whole"), env=env, check=True, capture_output=True)
    duration = time.perf_counter() - start
    reference = load_file(str(work / "whole" / "ckpt" / "rollout_000006" / "model.safetensors"))
    equal, rng = 0, random.Random(0)
    for trial in range(kills):
        run = work / f"trial{trial}"
        proc = subprocess.Popen(
            train_args(checkpoint, run), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        time.sleep(rng.uniform(0.2, 0.95) * duration)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        subprocess.run([*train_args(checkpoint, run), "--resume"], env=env, check=True, capture_output=True)
        final = load_file(str(run / "ckpt" / "rollout_000006" / "model.safetensors"))
        equal += all(torch.equal(final[k], reference[k]) for k in reference)
    return {"kills": kills, "bitwise equal": equal, "uninterrupted run s": round(duration, 1)}


def chunked_body(checkpoint: Path) -> dict:
    ctx, url = engine_process(checkpoint)
    with ctx as proc:

        def rss():
            return int(
                next(
                    line
                    for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines()
                    if line.startswith("VmRSS")
                ).split()[1]
            )

        def chunked(mib: int):
            def chunks():
                block = b"x" * (1 << 20)
                for _ in range(mib):
                    yield block

            try:
                return httpx.post(
                    url + "/generate", content=chunks(), headers={"content-type": "application/json"}, timeout=60
                ).status_code
            except httpx.HTTPError as exc:  # the server may close the connection once it has answered
                return f"closed ({type(exc).__name__})"

        httpx.post(url + "/generate", json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2}}, timeout=60)
        first_before = rss()
        chunked(64)  # the first 413 of the process also loads its code path
        before = rss()
        status = chunked(64)
        after = rss()
        chunked(256)
        after_256 = rss()
    return {
        "status": status,
        "first_413_growth_MiB": round((before - first_before) / 1024, 2),
        "rss_growth_MiB": round((after - before) / 1024, 2),
        "after_256_MiB_more": round((after_256 - after) / 1024, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5.0)
    ap.add_argument("--kill-every", type=float, default=30.0)
    ap.add_argument("--trainer-kills", type=int, default=20)
    ap.add_argument("--only-body", action="store_true", help="only the chunked-body measurement")
    args = ap.parse_args()
    checkpoint = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    print("chunked 64 MiB body:", chunked_body(checkpoint), flush=True)
    if args.only_body:
        return
    print(
        f"engines killed every {args.kill_every:.0f} s for {args.minutes} min under load:",
        engines_killed_under_load(checkpoint, args.minutes, args.kill_every),
        flush=True,
    )
    print(
        f"trainer killed at {args.trainer_kills} random moments:",
        trainer_killed(checkpoint, args.trainer_kills),
        flush=True,
    )


if __name__ == "__main__":
    main()
