"""``support-replay local-run``: engines, a router and torchrun trainer ranks as local processes.

For testing on one machine exactly what a run on several machines starts by hand:
``support-replay serve`` per engine, one ``support-replay router --engine URL ...`` in front of
them, and ``torchrun ... -m support_replay.cli train --rollout-url ROUTER`` for the trainer
ranks (docs/scaling.md). Here they all listen on loopback ports, their logs go to
``OUTPUT_DIR/logs``, and everything stops when the trainer ends. Nothing else is orchestrated.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx

from .errors import SupportReplayError


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(
    url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0, log: Path | None = None
) -> None:
    """Until ``url/health`` answers 200; fails naming the process's last output if it exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise SupportReplayError(f"process for {url} exited with {proc.returncode}: {tail}")
        try:
            # SGLang's /health runs a one-token generation (about a second on a CPU): give it time to answer
            if httpx.get(url + "/health", timeout=5.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SupportReplayError(f"{url} not healthy after {timeout} s")


def wait_smg_workers(
    url: str, count: int, proc: subprocess.Popen | None = None, log: Path | None = None, timeout: float = 120.0
) -> list[dict]:
    """smg's workers (its RL control plane's list) once ``count`` are registered and ready: it registers a worker
    after its probe answers, so a request sent before may find none."""
    deadline, workers = time.monotonic() + timeout, []
    while time.monotonic() < deadline:
        workers = httpx.get(url + "/v1/rl/workers", timeout=5).json().get("workers", [])
        if len(workers) == count and all(w.get("health") == "ready" for w in workers):
            return workers
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-2000:] if log is not None and log.exists() else ""
            raise SupportReplayError(f"smg at {url} exited with {proc.returncode}: {tail}")
        time.sleep(0.2)
    raise SupportReplayError(f"smg at {url}: {count} ready workers expected after {timeout} s, it lists {workers}")


@contextmanager
def process(args: list[str], url: str | None, log: Path, timeout: float = 120.0, env: dict | None = None):
    """A child process (output to ``log``, never a pipe that could fill), healthy before the block,
    terminated after it."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        out.write(f"$ {shlex.join(args)}\n")  # what ran, first
        out.flush()
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,  # its own process group: a server's children (SGLang's scheduler...) go with it
        )
        try:
            if url is not None:
                wait_healthy(url, proc, timeout, log)
            yield proc
        finally:
            stop_group(proc)


def stop_group(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM to ``proc``'s process group, SIGKILL to whatever of it is left after ``grace`` seconds; returns once
    the group is gone (SGLang's children take 5-10 s to exit after its launcher)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        proc.wait()
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        proc.poll()  # reaps the leader, so the group can empty
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _flag_value(args: list[str], flag: str) -> str | None:
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


def engines_behind_router(
    stack: ExitStack,
    commands: list[list[str]],
    ports: list[int],
    logs: Path,
    *,
    host: str = "127.0.0.1",
    router_port: int | None = None,
    request_timeout: float | None = None,
    start_timeout: float = 600.0,
    env: dict | None = None,
) -> tuple[list[str], str]:
    """Engine ``i`` (``commands[i]``, listening on loopback ``ports[i]``) and our router in front of them, in
    ``stack``: the engines start side by side, and the router once every one is healthy; ``(engine URLs, router
    URL)``."""
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    started = [
        (stack.enter_context(process(command, None, logs / f"engine{i}.log", env=env)), logs / f"engine{i}.log")
        for i, command in enumerate(commands)
    ]
    for url, (proc, log) in zip(urls, started):
        wait_healthy(url, proc, start_timeout, log)
    router_port = router_port or free_port()
    router = f"http://{host}:{router_port}"
    command = [sys.executable, "-m", "support_replay.cli", "router", "--host", host, "--port", str(router_port)]
    if request_timeout is not None:
        command += ["--request-timeout", str(request_timeout)]
    stack.enter_context(process([*command, *(a for u in urls for a in ("--engine", u))], router, logs / "router.log"))
    return urls, router


def local_run(train_args: list[str], *, engines: int, nproc_per_node: int, serve_args: list[str] | None = None) -> int:
    """``engines`` serve processes behind a router and ``nproc_per_node`` torchrun trainer ranks
    running ``train train_args --rollout-url ROUTER``; returns the trainer's exit status."""
    if engines < 1 or nproc_per_node < 1:
        raise SupportReplayError(f"local-run: --engines={engines} and --nproc-per-node={nproc_per_node} must be >= 1")
    if _flag_value(train_args, "--rollout-url"):
        raise SupportReplayError(
            "local-run: --rollout-url is the router local-run starts; leave it out of the trainer's flags"
        )
    checkpoint = _flag_value(train_args, "--hf-checkpoint")
    if checkpoint is None:
        from .modeling.checkpoints import smollm2_checkpoint

        checkpoint = str(smollm2_checkpoint())
    output = Path(_flag_value(train_args, "--output-dir") or "runs/latest").resolve()
    output.mkdir(parents=True, exist_ok=True)
    logs = output / "logs"
    cli = [sys.executable, "-m", "support_replay.cli"]
    with ExitStack() as stack:
        ports = [free_port() for _ in range(engines)]
        commands = [
            [
                *cli,
                "serve",
                "--hf-checkpoint",
                checkpoint,
                "--port",
                str(port),
                "--weights-dir",
                str(output),
                *(serve_args or []),
            ]
            for port in ports
        ]
        # the cores shared out: torchrun gives its ranks one thread each; an engine left to torch's default takes
        # every core, and 2 engines beside 2 ranks on 2 cores ran GRPO steps 3.3x slower (bench/ray_run.py)
        cores = os.cpu_count() or 1
        threads = (
            {}
            if "OMP_NUM_THREADS" in os.environ
            else {"OMP_NUM_THREADS": str(max(1, cores // (engines + nproc_per_node)))}
        )
        urls, router = engines_behind_router(stack, commands, ports, logs, env=threads)
        print(
            f"local-run: {engines} engine(s) {urls} behind the router {router}; {nproc_per_node} trainer rank(s); "
            f"logs in {logs}",
            flush=True,
        )
        trainer = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc_per_node}",
            "-m",
            "support_replay.cli",
            "train",
            *train_args,
            "--rollout-url",
            router,
        ]
        return subprocess.run(trainer, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
