"""One rollout of real size (docs/reliability.md, "Rollouts of any size"): 512 prompts x 8 samples =
4,096 requests, on the tiny test model, so the queueing and not the model is measured.

Runs ``train --num-rollout 1`` three ways: the in-process engine (queue 256), through ``serve``
(queue 256; the HTTP backend keeps 64 requests in flight), and through our router over that
``serve``. Prints failed samples, regenerated groups, the engine's 503 count and the time.

    python bench/large_rollout.py [--prompts 512] [--samples 8] [--paths in-process,serve,router]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from processes import engine_process, router_process  # noqa: E402
from support_replay.train import train  # noqa: E402
from support_replay.train.config import RunConfig  # noqa: E402
from tiny_model import build_tiny_checkpoint  # noqa: E402


def run(checkpoint: Path, out: Path, prompts: int, samples: int, url: str | None) -> tuple[dict, float]:
    cfg = RunConfig(
        hf_checkpoint=str(checkpoint),
        num_rollout=1,
        rollout_batch_size=prompts,
        n_samples_per_prompt=samples,
        global_batch_size=prompts * samples,
        micro_batch_size=64,
        rollout_max_response_len=8,
        rollout_top_p=0.9,
        rollout_top_k=16,
        output_dir=str(out),
        progress=False,
        ci_test=True,
        rollout_url=url,
        custom_rm_path="rewards_for_tests:digit_share",
    )
    start = time.perf_counter()
    rows = train(cfg)
    return rows[-1], time.perf_counter() - start


def overloaded(url: str) -> int:
    text = httpx.get(url + "/metrics", timeout=30).text
    return int(
        sum(
            float(line.split()[-1])
            for line in text.splitlines()
            if line.startswith("support_replay_requests_total") and "overloaded" in line
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=512)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--paths", default="in-process,serve,router")
    args = parser.parse_args()
    paths = args.paths.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpt = build_tiny_checkpoint(tmp / "tiny")
        results = []
        if "in-process" in paths:
            row, secs = run(ckpt, tmp / "a", args.prompts, args.samples, None)
            results.append(("in-process", row, secs, "-"))
        if "serve" in paths or "router" in paths:
            engine, url = engine_process(ckpt)
            with engine:
                if "serve" in paths:
                    row, secs = run(ckpt, tmp / "b", args.prompts, args.samples, url)
                    results.append(("serve", row, secs, overloaded(url)))
                if "router" in paths:
                    router, rurl = router_process([url])
                    with router:
                        before = overloaded(url)
                        row, secs = run(ckpt, tmp / "c", args.prompts, args.samples, rurl)
                        results.append(("router -> serve", row, secs, overloaded(url) - before))
    print(
        f"\n{args.prompts} prompts x {args.samples} samples = {args.prompts * args.samples} requests, one rollout, "
        "tiny model\n"
    )
    print("| path | samples trained | failed samples | regenerated groups | engine 503s | time (s) |")
    print("|---|---|---|---|---|---|")
    for name, row, secs, busy in results:
        print(
            f"| {name} | {row.get('samples', '?')} | {row['failed_samples']} | {row['regenerated_groups']} | {busy} | "
            f"{secs:.1f} |"
        )
    print(
        json.dumps({name: {k: row[k] for k in ("failed_samples", "regenerated_groups")} for name, row, _, _ in results})
    )


if __name__ == "__main__":
    main()
