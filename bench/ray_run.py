"""ray-run on a two-node Ray cluster on this machine: Ray's overhead against local-run, an engine killed
mid-rollout, and a soak with engines killed over and over.

    python bench/ray_run.py [--model smollm2|tiny] [--rollouts 6] [--what overhead,kill,soak,vllm] [--soak-minutes 10]

The cluster is Ray's own ``ray.cluster_utils.Cluster``: a head and one added node, each declaring 2 CPUs and 2
``sim_gpu`` (the custom resource a device is on a machine without CUDA), object stores of 128 MB, dashboard off,
every process on loopback. The run: 2 trainer ranks (``--actor-num-nodes 1 --actor-num-gpus-per-node 2``) and
2 engines (``--rollout-num-gpus 2 --rollout-num-gpus-per-engine 1``): PACK puts the ranks on one node and the
engines on the other. GRPO on the built-in arithmetic task, 4 prompts x 4 samples, top_p 0.8, top_k 32, --ci-test.
Every process computes with one thread (``OMP_NUM_THREADS=1``, as Ray sets it for an actor of under one CPU and
torchrun for its ranks): 4 processes on 2 cores.

- ``overhead``: the same flags through ``local-run --engines 2 --nproc-per-node 2`` and through ``ray-run``: wall
  time of the command, the time until the first rollout is trained, the mean step after it, the largest resident
  memory of all the processes the run started (sampled every 0.2 s); and the cluster itself: its start-up time and
  the memory of Ray's own processes, idle.
- ``kill``: engine0 is killed (SIGKILL) while it has requests in flight in the middle rollout; the step time of
  that rollout against the others', the restart and rejoin, the requests retried and the samples trained.
- ``soak``: for ``--soak-minutes``, an engine chosen in turn is killed every 20 s while training goes on.
- ``vllm``: one engine actor running vLLM's own OpenAI server (``--launch-server vllm``, from make vllm's
  ``.venv-vllm`` or ``$SUPPORT_REPLAY_VLLM_PYTHON``; eager, its model worker in the engine core's process, 4% of the
  memory for its KV cache) beside the two ranks: wall time, the first rollout, the mean step, --ci-test, and what
  the server's log shows (each push reloaded through ``/collective_rpc``, generation through
  ``/inference/v1/generate``). With ``--model tiny`` the tiny Llama the vLLM tests serve (its CPU backend takes
  head_dim 64).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import psutil

os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: loopback only
sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from support_replay.modeling.kernel_probe import cpu_identity  # noqa: E402

NODE = dict(num_cpus=2, resources={"sim_gpu": 2}, object_store_memory=128 * 2**20, node_ip_address="127.0.0.1")


def train_flags(checkpoint: str, out: Path, rollouts: int, max_len: int) -> list[str]:
    return [
        *("--hf-checkpoint", checkpoint, "--num-rollout", str(rollouts), "--rollout-batch-size", "4"),
        *("--n-samples-per-prompt", "4", "--global-batch-size", "16", "--rollout-max-response-len", str(max_len)),
        *("--rollout-top-p", "0.8", "--rollout-top-k", "32", "--ci-test", "--no-progress", "--output-dir", str(out)),
        *("--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2"),
    ]


def placed(flags: list[str]) -> list[str]:
    """ray-run's flags: two engines of one device each (local-run takes --engines instead)."""
    return [*flags, "--rollout-num-gpus-per-engine", "1", "--rollout-num-gpus", "2"]


class Run:
    """A command as a process: its output kept, the resident memory of it and its descendants sampled."""

    def __init__(self, command: list[str], out: Path, watch: psutil.Process | None = None):
        # one thread per process, in both launchers: what Ray gives an actor of under one CPU (OMP_NUM_THREADS=1)
        # and torchrun its ranks; local-run's engines would otherwise take both cores each
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "tests"), "OMP_NUM_THREADS": "1"}
        self.out, self.lines, self.peak = out, [], 0
        self.began = time.monotonic()
        self.proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.watch = watch  # also count these processes' descendants (the Ray cluster's workers)
        threading.Thread(target=lambda: self.lines.extend(iter(self.proc.stdout.readline, "")), daemon=True).start()
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while self.proc.poll() is None:
            self.peak = max(
                self.peak, tree_rss(psutil.Process(self.proc.pid)) + (tree_rss(self.watch) if self.watch else 0)
            )
            time.sleep(0.2)

    def wait(self) -> float:
        self.proc.wait()
        time.sleep(0.3)
        wall = time.monotonic() - self.began
        if self.proc.returncode != 0:
            raise SystemExit(f"{self.proc.args[:4]} failed ({self.proc.returncode}):\n{''.join(self.lines)[-4000:]}")
        return wall

    def line(self, start: str) -> str:
        while True:
            found = [x.strip() for x in list(self.lines) if x.strip().startswith(start)]
            if found:
                return found[0]
            if self.proc.poll() is not None:
                raise SystemExit("".join(self.lines)[-4000:])
            time.sleep(0.05)

    def rows(self) -> list[dict]:
        path = self.out / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def first_row_at(self) -> float:
        while not self.rows():
            if self.proc.poll() is not None:
                raise SystemExit("".join(self.lines)[-4000:])
            time.sleep(0.05)
        return time.monotonic() - self.began


def tree_rss(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def ray_command(address: str, flags: list[str], *options: str) -> list[str]:
    command = [sys.executable, "-m", "support_replay.cli", "ray-run", "--address", address, *options, "--"]
    return [*command, *placed(flags)]


def overhead(cluster, checkpoint: str, rollouts: int, max_len: int, work: Path) -> list[str]:
    lines = [
        "| launcher | wall s | first rollout trained at s | mean step s (rollouts 1+) | peak memory GB | ci-test max |"
    ]
    lines.append("|---|---:|---:|---:|---:|---:|")
    local_cmd = [sys.executable, "-m", "support_replay.cli", "local-run", "--engines", "2", "--nproc-per-node", "2"]
    for name in ("local-run", "ray-run"):
        out = work / name
        flags = train_flags(checkpoint, out, rollouts, max_len)
        command = [*local_cmd, "--", *flags] if name == "local-run" else ray_command(cluster.address, flags)
        run = Run(command, out, psutil.Process() if name == "ray-run" else None)
        first = run.first_row_at()
        wall = run.wait()
        rows = run.rows()
        step = statistics.mean(r["time_step"] for r in rows[1:])
        diff = max(r["train_rollout_logprob_abs_diff_max"] for r in rows)
        lines.append(f"| {name} | {wall:.1f} | {first:.1f} | {step:.2f} | {run.peak / 2**30:.2f} | {diff:.1e} |")
        if name == "ray-run":
            lines += [f"    {x.rstrip()}" for x in run.lines if x.startswith(("ray-run:", "  "))]
    return lines


def kill(cluster, checkpoint: str, rollouts: int, max_len: int, work: Path) -> list[str]:
    out = work / "kill"
    run = Run(ray_command(cluster.address, train_flags(checkpoint, out, rollouts, max_len)), out)
    pid, router = int(run.line("engine0:").split(" pid ")[1].split(",")[0]), run.line("router:").rsplit(" ", 1)[1]
    url = run.line("engine0:").rsplit(" ", 1)[1]
    middle = rollouts // 2
    while len(run.rows()) < middle:
        time.sleep(0.02)
    while not any(w["url"] == url and w.get("outstanding", 0) > 0 for w in httpx.get(router + "/workers").json()):
        time.sleep(0.005)
    os.kill(pid, signal.SIGKILL)
    killed_at = time.monotonic() - run.began
    run.wait()
    rows = run.rows()
    lines = ["| rollout | step s | samples trained | failed samples | ci-test max |", "|---:|---:|---:|---:|---:|"]
    for r in rows:
        mark = " (engine0 killed)" if r["rollout"] == middle else ""
        lines.append(
            f"| {r['rollout']}{mark} | {r['time_step']:.2f} | {r['samples']} | {r['failed_samples']} | "
            f"{r['train_rollout_logprob_abs_diff_max']:.1e} |"
        )
    others = [r["time_step"] for r in rows[1:] if r["rollout"] != middle]
    lines.append(
        f"killed at {killed_at:.1f} s; step with the kill {rows[middle]['time_step']:.2f} s, the others "
        f"(rollouts 1+) median {statistics.median(others):.2f} s"
    )
    lines += [f"    {x.rstrip()}" for x in run.lines if "ray-run: engine0" in x or "engine restarts" in x]
    return lines


def soak(cluster, checkpoint: str, minutes: float, max_len: int, work: Path) -> list[str]:
    out = work / "soak"
    flags = train_flags(checkpoint, out, 100000, max_len)
    run = Run(ray_command(cluster.address, flags, "--ray-engine-restarts", "-1"), out)  # -1: Ray's "no limit"
    names = ("engine0", "engine1")
    run.line("router:")
    kills, deadline, turn = 0, time.monotonic() + minutes * 60, 0
    while time.monotonic() < deadline:
        time.sleep(20)
        name = names[turn % 2]
        turn += 1
        lives = [x for x in list(run.lines) if f"{name} restarted" in x]
        pid = (
            int(lives[-1].split(" pid ")[1].split(" ")[0])
            if lives
            else int(run.line(name + ":").split(" pid ")[1].split(",")[0])
        )
        os.kill(pid, signal.SIGKILL)
        kills += 1
    rows = run.rows()
    run.proc.send_signal(signal.SIGINT)
    run.proc.wait()
    steps = sorted(r["time_step"] for r in rows[1:])
    restarts = sum("rejoined the router" in x for x in run.lines)
    return [
        f"{minutes:g} minutes: {len(rows)} rollouts, {kills} engines killed, {restarts} restarted and rejoined; "
        f"samples {sum(r['samples'] for r in rows)} (failed {sum(r['failed_samples'] for r in rows)}); "
        f"step p50 {steps[len(steps) // 2]:.2f} s, p90 {steps[int(len(steps) * 0.9)]:.2f} s; ci-test max "
        f"{max(r['train_rollout_logprob_abs_diff_max'] for r in rows):.1e}"
    ]


def vllm(cluster, checkpoint: str, rollouts: int, max_len: int, work: Path) -> list[str]:
    python = os.environ.get("SUPPORT_REPLAY_VLLM_PYTHON", str(Path(__file__).parents[1] / ".venv-vllm/bin/python"))
    out = work / "vllm"
    server = ("--launch-server", "vllm", "--launch-python", python, "--vllm-enforce-eager")
    server += ("--vllm-gpu-memory-utilization", "0.04")  # its context: the model's own
    flags = [*train_flags(checkpoint, out, rollouts, max_len), *server]
    flags += ["--rollout-num-gpus-per-engine", "1", "--rollout-num-gpus", "1"]
    command = [sys.executable, "-m", "support_replay.cli", "ray-run", "--address", cluster.address, "--", *flags]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # ray-run forwards VLLM_* to the engine actor
    run = Run(command, out, psutil.Process())
    first = run.first_row_at()
    wall = run.wait()
    rows = run.rows()
    step = statistics.mean(r["time_step"] for r in rows[1:]) if len(rows) > 1 else rows[0]["time_step"]
    diff = max(r["train_rollout_logprob_abs_diff_max"] for r in rows)
    log = (out / "logs" / "engine0.log").read_text()
    reloads, generates = log.count('"POST /collective_rpc HTTP/1.1" 200'), log.count("/inference/v1/generate")
    lines = ["| engine | wall s | first rollout trained at s | mean step s | peak memory GB | ci-test max |"]
    lines.append("|---|---:|---:|---:|---:|---:|")
    lines.append(
        f"| vLLM server (1 actor) | {wall:.1f} | {first:.1f} | {step:.2f} | {run.peak / 2**30:.2f} | {diff:.1e} |"
    )
    lines += [f"    {x.rstrip()}" for x in run.lines if x.startswith(("ray-run:", "  "))]
    lines.append(f"    the server's log: {reloads} reloads through /collective_rpc, {generates} generate calls")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--rollouts", type=int, default=6)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--what", default="overhead,kill")
    parser.add_argument("--soak-minutes", type=float, default=10)
    args = parser.parse_args()
    from ray.cluster_utils import Cluster

    work = Path(tempfile.mkdtemp())
    if args.model == "tiny":
        from tiny_model import build_tiny_checkpoint

        checkpoint = str(build_tiny_checkpoint(work / "tiny"))
        if "vllm" in args.what:
            from tiny_model import vllm_checkpoint

            checkpoint = str(vllm_checkpoint(Path(checkpoint), work / "tiny-llama"))
    else:
        from support_replay.modeling.checkpoints import smollm2_checkpoint

        checkpoint = str(smollm2_checkpoint())
    began = time.monotonic()
    cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    up = time.monotonic() - began
    time.sleep(2)
    idle = tree_rss(psutil.Process()) - psutil.Process().memory_info().rss
    print(
        f"# bench/ray_run.py --model {args.model} --rollouts {args.rollouts} --max-len {args.max_len} on "
        f"{cpu_identity()}, {time.strftime('%Y-%m-%d')}"
    )
    print(f"two-node cluster up in {up:.1f} s; Ray's own processes idle: {idle / 2**30:.2f} GB resident")
    try:
        for what in args.what.split(","):
            print(f"\n## {what}")
            if what == "soak":
                lines = soak(cluster, checkpoint, args.soak_minutes, args.max_len, work)
            else:
                lines = {"overhead": overhead, "kill": kill, "vllm": vllm}[what](
                    cluster, checkpoint, args.rollouts, args.max_len, work
                )
            print("\n".join(lines), flush=True)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()
