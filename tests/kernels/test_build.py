"""The project's compiled CPU kernels (kernels/build.py) build on this machine, and their vector sources
compile for every other ISA the build may take: a CPU of another kind builds them for its own ISA, and a source
that only compiles for this one (an include that AVX2's headers bring and AVX-512's do not) would leave that CPU
on PyTorch's slower functions, the kernels' tests skipped."""

import os
import shutil
import subprocess
import sysconfig

import pytest
import torch

from support_replay.kernels import build
from support_replay.kernels.build import cpu_name

COMPILER = shutil.which(os.environ.get("CXX", "c++"))  # the compiler PyTorch's extension builder calls
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="no C++ compiler here: PyTorch's own functions serve")
VECTOR_SOURCES = [source for source in build.SOURCES if "ATen/cpu/vec" in source.read_text()]


@needs_compiler
def test_the_kernels_build_on_this_cpu():
    module, why = build.built()
    assert module is not None, f"the CPU kernels did not build for {build._isa()[0]} on {cpu_name()}: {why}"


@needs_compiler
@pytest.mark.parametrize("isa", [isa for isa in build.ISA_FLAGS if isa != build._isa()[0]])
def test_the_vector_sources_compile_for_another_isa(isa):
    from torch.utils.cpp_extension import include_paths

    if build.is_built(build.build_name(build.SOURCES + build.HEADERS, isa)):
        return  # these very sources were built for it (`make kernels` builds every set the tests take): compiled
    includes = [f"-I{path}" for path in [*include_paths(), sysconfig.get_paths()["include"]]]
    command = [COMPILER, "-fsyntax-only", "-std=c++20", "-fopenmp", "-DTORCH_API_INCLUDE_EXTENSION_H", *includes]
    # the sources in parallel, a compiler each (seconds apiece: ATen's headers)
    runs = [
        subprocess.Popen([*command, *build.ISA_FLAGS[isa], str(source)], stderr=subprocess.PIPE, text=True)
        for source in VECTOR_SOURCES
    ]
    errors = [run.communicate()[1] for run in runs]  # read before waiting: a long error fills the pipe
    failed = {source.name: err for source, err, run in zip(VECTOR_SOURCES, errors, runs) if run.returncode != 0}
    assert not failed, f"for {isa} (torch {torch.__version__}): " + "\n".join(
        f"{name}: {err.strip()[:1500]}" for name, err in failed.items()
    )


def test_the_vector_sources_are_found():
    assert {source.name for source in VECTOR_SOURCES} >= {"decode_attention.cpp", "top_candidates.cpp"}
