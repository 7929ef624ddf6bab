"""Poison requests against a deterministic engine server (docs/reliability.md): for each poison,
63 good requests sent at the same moment must come out bit-identical to a run without it, and
the poison must get a 4xx; prints the time each poison took to be refused.

    python bench/poison.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from poison import POISONS, send_with  # noqa: E402
from processes import engine_process  # noqa: E402
from tiny_model import build_tiny_checkpoint  # noqa: E402


def main() -> None:
    checkpoint = build_tiny_checkpoint(Path(tempfile.mkdtemp()) / "tiny")
    ctx, url = engine_process(checkpoint, "--deterministic", "--max-batch-size", "64")
    client = httpx.Client(timeout=300)

    def post(body):
        if isinstance(body, bytes):
            r = client.post(url + "/generate", content=body, headers={"content-type": "application/json"})
        else:
            r = client.post(url + "/generate", json=body)
        return r.status_code, r.json() if r.headers.get("content-type", "").startswith("application/json") else {}

    with ctx:
        baseline, _ = send_with(post, 63)
        assert all(status == 200 for status, _, _ in baseline), "the good requests alone must succeed"
        print("| poison | status | refused in ms | the 63 good answers |")
        print("|---|---:|---:|---|")
        for name, poison in POISONS.items():
            goods, (status, seconds) = send_with(post, 63, poison)
            same = "bit-identical" if goods == baseline else "DIFFERENT"
            print(f"| {name} | {status} | {seconds * 1000:.1f} | {same} |", flush=True)


if __name__ == "__main__":
    main()
