"""The size of the test suite, counted statically: test functions, and the checks written in them (``assert``
statements, ``pytest.raises`` and ``pytest.warns`` blocks, ``assert_*`` calls of numpy, torch and the tests' own
helpers), so a change that makes the suite faster can show it checks no less.

    python3 tests/suite_size.py            # this tree
    python3 tests/suite_size.py --at REV   # the tree at a git revision (git show; nothing checked out)

Collected test items (parametrized cases) come from ``pytest --collect-only -q`` and are not counted here."""

from __future__ import annotations

import argparse
import ast
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _is_check_call(node: ast.Call) -> bool:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
    if name in ("raises", "warns"):
        return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "pytest"
    return name.startswith("assert_") or name == "assert_close"


def count(source: str) -> tuple[int, int]:
    """``(test functions, checks)`` in one test module's source."""
    tree = ast.parse(source)
    tests = sum(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith("test_")
        for node in ast.walk(tree)
    )
    checks = sum(
        isinstance(node, ast.Assert) or (isinstance(node, ast.Call) and _is_check_call(node)) for node in ast.walk(tree)
    )
    return tests, checks


def files(at: str | None) -> dict[str, str]:
    """``{path: source}`` of every Python file under tests/, here or at a revision."""
    if at is None:
        return {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "tests").rglob("*.py"))}
    names = subprocess.run(
        ["git", "ls-tree", "-r", "--name-only", at, "tests/"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {
        name: subprocess.run(["git", "show", f"{at}:{name}"], cwd=ROOT, capture_output=True, text=True).stdout
        for name in names
        if name.endswith(".py")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--at", help="a git revision (default: the working tree)")
    args = parser.parse_args()
    tests = checks = 0
    for source in files(args.at).values():
        t, c = count(source)
        tests, checks = tests + t, checks + c
    print(f"tests/ at {args.at or 'the working tree'}: {tests} test functions, {checks} checks")


if __name__ == "__main__":
    main()
