"""Where the tests find the real vLLM (its own venv, ``make vllm``) and whether it can run.

``make vllm`` is best effort: an install that fails part way leaves a venv without the package.
The tests then skip and say why, instead of failing in a server that cannot start.
"""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path

VLLM_PYTHON = Path(
    os.environ.get("SUPPORT_REPLAY_VLLM_PYTHON", Path(__file__).parents[1] / ".venv-vllm" / "bin" / "python")
)

_HAS_VLLM = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"


@functools.cache
def vllm_missing() -> str | None:
    """Why the real vLLM cannot run here, or None when ``VLLM_PYTHON`` has the package."""
    if not VLLM_PYTHON.exists():
        return f"no vLLM environment at {VLLM_PYTHON} (make vllm)"
    probe = subprocess.run([str(VLLM_PYTHON), "-c", _HAS_VLLM], capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        detail = (probe.stderr.strip().splitlines() or ["no vllm package"])[-1]
        return f"{VLLM_PYTHON} cannot import vllm ({detail}): its install did not finish (make vllm)"
    return None
