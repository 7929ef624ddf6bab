"""Start our server, our router or sglang-router as real processes on loopback, for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path

from support_replay.launch import free_port, wait_healthy  # the package's own, shared with local-run


@contextmanager
def process(args: list[str], url: str, health: bool = True, timeout: float = 120.0):
    # output to a file, not a pipe: a chatty server (vLLM) would block once a pipe is full
    log = tempfile.NamedTemporaryFile("w+", prefix="support-replay-proc-", suffix=".log", delete=False)
    proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        if health:
            wait_healthy(url, proc, timeout, Path(log.name))
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
