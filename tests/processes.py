"""Start our server, our router or sglang-router as real processes on loopback, for tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout: float = 120.0, log=None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            tail = Path(log.name).read_text()[-2000:] if log is not None else ""
            raise RuntimeError(f"process for {url} exited with {proc.returncode}: {tail}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


@contextmanager
def process(args: list[str], url: str, health: bool = True, timeout: float = 120.0):
    # output to a file, not a pipe: a chatty server (vLLM) would block once a pipe is full
    log = tempfile.NamedTemporaryFile("w+", prefix="support-replay-proc-", suffix=".log", delete=False)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        if health:
            wait_healthy(url, proc, timeout, log)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        os.unlink(log.name)


def engine_process(checkpoint, *extra: str):
    """``support-replay serve`` on a free port; weights load from anywhere under pytest's base
    temporary directory (the checkpoint's parent), where the tests stage them."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "support_replay.cli", "serve", "--hf-checkpoint", str(checkpoint), "--port", str(port),
            "--weights-dir", str(Path(checkpoint).parent), *extra]
    return process(args, url), url


def router_process(engine_urls: list[str], health_interval: float = 0.5):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, "-m", "support_replay.cli", "router", "--port", str(port), "--health-interval", str(health_interval)]
    for u in engine_urls:
        args += ["--engine", u]
    return process(args, url), url
