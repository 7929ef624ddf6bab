"""Start our server, our router or sglang-router as real processes on loopback, for tests."""

from __future__ import annotations

import os
import sys
import tempfile
from contextlib import ExitStack, contextmanager
from pathlib import Path

from support_replay.launch import free_port, wait_healthy  # noqa: F401  (the package's own, shared with local-run)
from support_replay.launch import process as launch_process


@contextmanager
def process(args: list[str], url: str, health: bool = True, timeout: float = 120.0, env: dict | None = None):
    """``launch.process`` with its output in a temporary file (``proc.log``, for a caller that waits for it
    itself), removed afterwards."""
    fd, name = tempfile.mkstemp(prefix="support-replay-proc-", suffix=".log")
    os.close(fd)
    log = Path(name)
    try:
        with launch_process(args, url if health else None, log, timeout, env) as proc:
            proc.log = log
            yield proc
    finally:
        log.unlink(missing_ok=True)


def terminate_group(proc) -> None:
    """SIGTERM to a ``process``'s group without waiting, so that several stop side by side (its context's exit
    then waits for it)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass


def engine_process(checkpoint, *extra: str, health: bool = True, env: dict | None = None):
    """``support-replay serve`` on a free port; weights load from anywhere under pytest's base
    temporary directory (the checkpoint's parent), where the tests stage them. ``env``: added to this process's
    (a test's gate: tests/stop_gate.py, tests/push_gate.py)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        sys.executable,
        "-m",
        "support_replay.cli",
        "serve",
        "--hf-checkpoint",
        str(checkpoint),
        "--port",
        str(port),
        "--weights-dir",
        str(Path(checkpoint).parent),
        *extra,
    ]
    return process(args, url, health=health, env=env), url


@contextmanager
def engine_processes(checkpoint, count: int, *extra: str):
    """``count`` engines (``engine_process``) started side by side, each healthy before the block: ``[(proc, url)]``
    (one after the other, each start waited for, took about twice as long on 2 cores)."""
    with ExitStack() as stack:
        started = []
        for _ in range(count):
            ctx, url = engine_process(checkpoint, *extra, health=False)
            started.append((stack.enter_context(ctx), url))
        for proc, url in started:
            wait_healthy(url, proc, 120.0, proc.log)
        yield started


ENGINES = Path(__file__).parent / "engines"


def sglang_standin_process(checkpoint):
    """``(process context, url)`` of a server answering as SGLang 0.5.23 through its own code
    (``engines/sglang_standin.py``); skips the test where SGLang's code is not available."""
    import pytest

    sys.path.insert(0, str(ENGINES))
    import sglang_code

    try:
        sglang_code.load()
    except sglang_code.Unavailable as exc:
        pytest.skip(f"SGLang's code is not available here: {exc}")
    from exercised import ran

    ran("SGLang (its wheel's sampler and mask code, in a stand-in server)", sglang_code.VERSION)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [sys.executable, str(ENGINES / "sglang_standin.py"), "--checkpoint", str(checkpoint), "--port", str(port)]
    return process(args, url), url


def vllm_server_args(python, checkpoint, port: int) -> list[str]:
    """The real vLLM CPU server the tests and the fixture generator run (eager): the tiny Llama in fp32,
    processed log-probs (log mu), unlimited log-probs, and ``/inference/v1/generate``
    (``--enable-scale-out``), run-time LoRA adapters; its RL weight routes also need ``VLLM_SERVER_DEV_MODE=1``,
    its adapter routes ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``."""
    return [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(checkpoint), "--served-model-name", "tiny",
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "float32", "--max-model-len", "256",
        "--logprobs-mode", "processed_logprobs", "--max-logprobs", "-1",
        "--gpu-memory-utilization", "0.1", "--enable-scale-out",
        "--enforce-eager",  # PyTorch eager, no inductor graph compiled at start: up 11 s sooner on 2 cores
        # LoRA adapters loaded at run time (--lora-sync adapter; also needs VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)
        "--enable-lora", "--max-lora-rank", "8", "--max-loras", "1",
    ]  # fmt: skip


def router_process(engine_urls: list[str], health_interval: float = 0.5):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        sys.executable,
        "-m",
        "support_replay.cli",
        "router",
        "--port",
        str(port),
        "--health-interval",
        str(health_interval),
    ]
    for u in engine_urls:
        args += ["--engine", u]
    return process(args, url), url
