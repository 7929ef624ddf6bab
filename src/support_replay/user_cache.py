"""Where the project keeps what it makes once per machine: compiled kernels, measurements, converted checkpoints."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$SUPPORT_REPLAY_CACHE``, else ``~/.cache/support-replay``."""
    return Path(os.environ.get("SUPPORT_REPLAY_CACHE", Path.home() / ".cache" / "support-replay"))
