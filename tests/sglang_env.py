"""Where the tests find the real SGLang (its own venv, ``make sglang``), and its server started as a user would.

``make sglang`` is best effort like ``make vllm``: where the install did not finish the tests skip and say why,
and under CI=true that skip fails the run (tests/conftest.py).
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import NamedTuple

SGLANG_PYTHON = Path(
    os.environ.get("SUPPORT_REPLAY_SGLANG_PYTHON", Path(__file__).parents[1] / ".venv-sglang" / "bin" / "python")
)
SGLANG_VERSION = "0.5.23"
_VERSION = "import importlib.metadata as m; print(m.version('sglang'))"


@functools.cache
def sglang_missing() -> str | None:
    """Why the real SGLang cannot run here, or None when ``SGLANG_PYTHON`` has SGLang 0.5.23."""
    if not SGLANG_PYTHON.exists():
        return f"no SGLang environment at {SGLANG_PYTHON} (make sglang)"
    probe = subprocess.run([str(SGLANG_PYTHON), "-c", _VERSION], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        detail = (probe.stderr.strip().splitlines() or ["no sglang package"])[-1]
        return f"{SGLANG_PYTHON} has no SGLang ({detail}): its install did not finish (make sglang)"
    if probe.stdout.strip() != SGLANG_VERSION:
        return f"{SGLANG_PYTHON} has SGLang {probe.stdout.strip()}, the tests are for {SGLANG_VERSION} (make sglang)"
    return None


def sglang_server_args(checkpoint, port: int, *extra: str) -> list[str]:
    """SGLang's own server on its CPU path, as a user launches it (docs/engines.md): torch-native attention, the
    PyTorch sampler, float32, no overlap scheduling; ``--sleep-on-idle`` (else the idle scheduler keeps a core
    busy); a fixed seed."""
    return [
        str(SGLANG_PYTHON),
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(checkpoint),
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--sampling-backend",
        "pytorch",
        "--disable-overlap-schedule",
        "--dtype",
        "float32",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-total-tokens",
        "4096",
        "--skip-server-warmup",
        "--random-seed",
        "0",
        "--sleep-on-idle",
        *extra,
    ]


SGLANG_ENV = {"SGLANG_USE_CPU_ENGINE": "1", "HF_HUB_OFFLINE": "1"}


def sglang_process(checkpoint, port: int, *extra: str, timeout: float = 300.0, health: bool = True):
    """``(process context, url)`` of the server (launcher, tokenizer manager, scheduler, detokenizer): the
    project's ``launch.process``, which runs it in a process group of its own, waits for ``/health`` (unless
    ``health`` is false: the caller waits) and stops the whole group after."""
    from processes import process

    url = f"http://127.0.0.1:{port}"
    args = sglang_server_args(checkpoint, port, *extra)
    return process(args, url, health=health, timeout=timeout, env=SGLANG_ENV), url


class SGLangServer(NamedTuple):
    url: str
    checkpoint: Path
    log: Path  # its output (uvicorn's access lines among it)

    def generate_calls(self) -> int:
        """How many ``POST /generate`` it answered 200, from its access log."""
        return self.log.read_text(errors="replace").count('"POST /generate HTTP/1.1" 200')
