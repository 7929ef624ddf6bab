"""SGLang's own server-argument parser, from its published wheel, for checking the command lines we build.

``sglang.srt.server_args.prepare_server_args`` (what ``python -m sglang.launch_server`` calls) imports
more of SGLang than its sampling code does: ``sglang.srt.utils`` imports triton, zmq, pybase64 and
IPython on load (observed). Those wheels, without their own dependencies (no CUDA torch), are installed
once into the user cache; ``pythonpath()`` is the directory to put on ``PYTHONPATH``. It raises
``Unavailable`` when the registry cannot be reached.
"""

from __future__ import annotations

import subprocess
import sys

from sglang_code import VERSION, Unavailable, cache_root

WHEELS = [
    f"sglang=={VERSION}",
    "triton==3.9.0",
    "pybase64==1.5.1",
    "pyzmq==27.3.0",
    "ipython==9.18.1",
    "traitlets==5.16.1",
]


def pythonpath() -> str:
    target = cache_root().parent / f"sglang-{VERSION}-parser"
    done_marker = target / ".installed"
    if done_marker.exists():
        return str(target)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), *WHEELS],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if done.returncode != 0:
        raise Unavailable(f"pip install {' '.join(WHEELS)} failed: {done.stderr.strip()[-300:]}")
    done_marker.write_text(" ".join(WHEELS) + "\n")
    return str(target)
