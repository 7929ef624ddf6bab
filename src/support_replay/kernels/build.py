"""The project's compiled CPU kernels (csrc/*.cpp), built once per machine into the user cache.

One extension holds them all (one build, its sources compiled in parallel): the decode attention
(modeling/decode_attention.py), the elementwise work around a decode step's products (modeling/decode_layer.py), a
float32 decode step's layers in one call and the watch over the attributes a fused step reads (engine/fused_step.py),
and the sampler's top candidates (kernels/top_candidates.py).
It is built with PyTorch's extension builder for the vector ISA PyTorch itself runs at
(``torch.backends.cpu.get_cpu_capability()``, which follows ``ATEN_CPU_CAPABILITY``), without fused multiply-adds
the source does not write itself (``-ffp-contract=off``: a product and a sum round twice, as ATen's separate
kernels do), under a name carrying the ISA and the sources' digest, so an edited source is a new build and never
a stale one. Each user of a kernel checks it before using it; a machine without a compiler keeps PyTorch's own.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
SOURCES = [
    CSRC / name
    for name in (
        "bindings.cpp",
        "decode_attention.cpp",
        "decode_layer.cpp",
        "decode_layers.cpp",
        "invariant_layers.cpp",
        "invariant_product.cpp",
        "slot_watch.cpp",
        "top_candidates.cpp",
    )
]
HEADERS = [CSRC / "kernels.h", CSRC / "lanes.h"]  # in the build's name too: an edited declaration is a new build


# The compiler flags of each vector ISA the build may take: PyTorch's own choice on the CPU it runs on
ISA_FLAGS = {
    "avx512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-DCPU_CAPABILITY=AVX512",
               "-DCPU_CAPABILITY_AVX512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "default": [],  # ATen's portable vectors
}  # fmt: skip


def _isa() -> tuple[str, list[str]]:
    """The vector ISA to build for (PyTorch's own choice on this CPU) and its compiler flags."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    isa = "avx512" if capability.startswith("AVX512") else "avx2" if capability == "AVX2" else "default"
    return isa, ISA_FLAGS[isa]


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), or the platform's processor string."""
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def build_name(sources: list[Path], isa: str) -> str:
    """The extension's name: the ISA and the sources' digest."""
    digest = hashlib.sha256()
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return f"support_replay_cpu_kernels_{isa}_{digest.hexdigest()[:12]}"


def build_directory(name: str) -> Path:
    from ..user_cache import cache_dir

    return cache_dir() / "extensions" / f"torch-{torch.__version__.replace('+', '-')}" / name


def is_built(name: str) -> bool:
    """Whether the build ``name`` (``build_name``: an ISA and the sources' digest) is in the user cache."""
    return any(build_directory(name).glob(f"{name}*.so"))


def _ninja_on_path() -> None:
    """PyTorch's builder runs ``ninja`` from PATH: the ``ninja`` package's (a dependency) first, whatever the system
    has, so that every process builds with one ninja. Two versions on one build directory (a system 1.11 and the
    package's 1.13 here, found by processes with and without the venv's bin on PATH) each take the other's log for
    stale and rebuild everything, about 45 s on 2 cores, at every switch. PATH gains a folder holding only a link to
    the package's binary, so nothing else found on PATH changes."""
    try:
        import ninja
    except ImportError:
        return
    binary = Path(ninja.BIN_DIR) / "ninja"
    if not binary.is_file():
        return
    from ..user_cache import cache_dir

    folder = cache_dir() / "ninja" / ninja.__version__
    link = folder / "ninja"
    if not link.exists():
        folder.mkdir(parents=True, exist_ok=True)
        spare = folder / f"ninja.{os.getpid()}"
        spare.unlink(missing_ok=True)
        spare.symlink_to(binary)
        os.replace(spare, link)  # atomic: a process beside this one sees the link or nothing
    path = os.environ.get("PATH", "").split(os.pathsep)
    if path[0] != str(folder):
        os.environ["PATH"] = os.pathsep.join([str(folder), *(p for p in path if p != str(folder))])


STALE_LOCK_SECONDS = 900  # a build takes a minute or two; a lock this old was left by a process that died building


def _drop_a_stale_lock(directory: Path, older_than: float = STALE_LOCK_SECONDS) -> None:
    """PyTorch's builder waits, without end, for the ``lock`` file of whichever process builds or loads; a process
    killed meanwhile leaves it behind, and every later process would wait forever. One older than ``older_than``
    seconds is removed (saying so)."""
    lock = directory / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age >= older_than:
        log.warning(
            "CPU kernels: removing a build lock left %.0f s ago by a process that never finished: %s", age, lock
        )
        lock.unlink(missing_ok=True)


@contextlib.contextmanager
def _one_builder(directory: Path) -> Iterator[None]:
    """One process at a time in PyTorch's builder for ``directory``, under a lock the OS lets go of when its holder
    dies. PyTorch takes its ``lock`` file at every load, a built extension's too (to run ninja), so a process
    killed in that second (the tests kill engines and trainer ranks as they start) left it for good; holding this
    lock, any ``lock`` file there is such a leftover and is removed at once. Without ``fcntl`` (not POSIX) a
    leftover goes after ``STALE_LOCK_SECONDS``."""
    try:
        import fcntl
    except ImportError:
        _drop_a_stale_lock(directory)
        yield
        return
    with open(directory / "builder.flock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            _drop_a_stale_lock(directory, older_than=0)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def built() -> tuple[ModuleType | None, str]:
    """The extension built for this CPU and PyTorch, or None and why it cannot be."""
    missing = [str(source) for source in SOURCES + HEADERS if not source.exists()]
    if missing:
        return None, f"its sources {missing} are not installed"
    isa, flags = _isa()
    name = build_name(SOURCES + HEADERS, isa)
    directory = build_directory(name)
    if not is_built(name):
        log.info("CPU kernels: building them for %s once, into %s (about a minute)", isa, directory)
    try:
        from torch.utils.cpp_extension import load

        _ninja_on_path()
        directory.mkdir(parents=True, exist_ok=True)
        with _one_builder(directory):
            module = load(
                name=name,
                sources=[str(source) for source in SOURCES],
                extra_cflags=["-O3", "-fopenmp", "-ffp-contract=off", *flags],
                extra_ldflags=["-fopenmp"],
                build_directory=str(directory),
                verbose=False,
            )
    except Exception as exc:  # no compiler, no ninja, a failed build: PyTorch's own kernels stay
        detail = str(exc).strip().splitlines()
        return None, f"it did not build in {directory}: {type(exc).__name__}: {detail[-1] if detail else ''}"[:400]
    return module, ""


def checked(check: Callable[[ModuleType], str]) -> tuple[ModuleType | None, str]:
    """The extension where it builds and ``check(module)`` finds nothing ("") against PyTorch's or the models' own
    functions, else None and why not (what did not build, or the disagreement)."""
    module, why = built()
    if module is None:
        return None, why
    disagreement = check(module)
    return (None, disagreement) if disagreement else (module, "")


if __name__ == "__main__":  # python -m support_replay.kernels.build: build them now, say where
    module, reason = built()
    print(f"CPU kernels: {module.__file__}" if module is not None else f"CPU kernels: not built ({reason})")
