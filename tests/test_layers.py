"""The layers of the package: imports point downwards, and describing a request loads no model."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parent.parent / "src" / "support_replay"
# the only places above the engine that run it in-process (the in-process engine kind)
RUNS_THE_ENGINE = {"backends/local.py", "backends/in_process.py"}
# the engine's records, which the trainer builds an in-process engine's settings from
ENGINE_RECORDS = ("support_replay.engine.settings", "support_replay.engine.kv_budget", "support_replay.engine.limits")


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the support_replay modules a file imports (relative imports resolved)."""
    package = ["support_replay", *path.relative_to(PACKAGE).parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return {n for n in names if n.startswith("support_replay")}


def test_the_core_imports_torch_and_numpy_alone():
    core = sorted((PACKAGE / "core").glob("*.py"))
    assert len(core) >= 8, core
    for path in core:
        allowed = ("support_replay.core", "support_replay.errors")
        outside = [m for m in imported_modules(path) if m != "support_replay" and not m.startswith(allowed)]
        assert not outside, f"{path.name} imports {outside}"
        tree = ast.parse(path.read_text())
        third_party = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        third_party |= {
            n.module.split(".")[0]
            for n in ast.walk(tree)
            if isinstance(n, ast.ImportFrom) and n.level == 0 and n.module
        }
        assert third_party <= {
            "torch",
            "numpy",
            "__future__",
            "math",
            "functools",
            "struct",
            "base64",
            "binascii",
            "io",
            "dataclasses",
            "collections",
            "typing",
        }, (path.name, third_party)


def test_the_kernels_import_torch_and_the_core_alone():
    """kernels/ sits below modeling, the engine and the trainer: it imports torch, the core and its own leaves."""
    kernels = sorted((PACKAGE / "kernels").glob("*.py"))
    assert len(kernels) >= 3, kernels
    allowed = ("support_replay.kernels", "support_replay.core", "support_replay.errors", "support_replay.user_cache")
    for path in kernels:
        outside = [m for m in imported_modules(path) if m != "support_replay" and not m.startswith(allowed)]
        assert not outside, f"{path.name} imports {outside}"
        tree = ast.parse(path.read_text())
        third_party = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        third_party |= {
            n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0
        }
        assert "transformers" not in third_party, path.name


@pytest.mark.parametrize("layer", ["backends", "rollout", "train", "audit"])
def test_only_the_in_process_paths_import_the_engine(layer):
    for path in sorted((PACKAGE / layer).glob("*.py")):
        rel = f"{layer}/{path.name}"
        engine = [
            m
            for m in imported_modules(path)
            if (m == "support_replay.engine" or m.startswith("support_replay.engine."))
            and not m.startswith(ENGINE_RECORDS)
        ]
        assert not engine or rel in RUNS_THE_ENGINE, f"{rel} imports {engine}"


@pytest.mark.processes
def test_an_http_backend_loads_neither_the_engine_nor_transformers():
    code = (
        "import sys, support_replay.backends.sglang, support_replay.backends.vllm, support_replay.rollout\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('transformers', 'support_replay.engine')))\n"
        "print(bad)\n"
        "sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_nothing_imports_the_command_line():
    """cli.py sits on top: the flag systems it uses live below it (serving/serve_flags.py, train/config.py)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "cli.py" and path.parent == PACKAGE:
            continue
        assert "support_replay.cli" not in imported_modules(path), path.relative_to(PACKAGE)
