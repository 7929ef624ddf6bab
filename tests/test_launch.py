"""`support-replay local-run`: two engines behind the router and two torchrun trainer ranks, as
local processes started by one command line, GRPO with --ci-test through them."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support_replay.cli import main

pytestmark = pytest.mark.slow


@pytest.mark.processes
def test_local_run_starts_engines_a_router_and_torchrun_ranks(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    train_flags = [
        "--hf-checkpoint",
        str(tiny_checkpoint),
        "--num-rollout",
        "2",
        "--rollout-batch-size",
        "2",
        "--n-samples-per-prompt",
        "4",
        "--global-batch-size",
        "4",
        "--rollout-max-response-len",
        "10",
        "--lr",
        "1e-3",
        "--custom-rm-path",
        "rewards_for_tests:digit_share",
        "--rollout-top-p",
        "0.8",
        "--rollout-top-k",
        "32",
        "--ci-test",
        "--no-progress",
        "--output-dir",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "support_replay.cli",
            "local-run",
            "--engines",
            "2",
            "--nproc-per-node",
            "2",
            "--",
            *train_flags,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout"] for r in rows] == [0, 1]
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)
    assert {p.name for p in (out / "logs").iterdir()} == {"engine0.log", "engine1.log", "router.log"}
    assert "2 engine(s)" in done.stdout


def test_local_run_refuses_a_rollout_url_of_its_own(capsys):
    assert main(["local-run", "--", "--rollout-url", "http://elsewhere:1"]) == 2
    assert "--rollout-url is the router local-run starts" in capsys.readouterr().err
