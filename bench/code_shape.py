"""The shape of the source tree, as a table: sizes, long functions, long lines, tests per folder.

    python bench/code_shape.py [--root .] [--show path.py:Qualified.name ...] [--duplicates]

Counts, for ``src/support_replay``: modules and lines; modules over 600 lines; functions over 60
lines (listed); lines over 120 characters; the largest classes (lines, methods); the functions with
the most parameters; the modules outside ``backends/`` that switch on the engine kind (compare
``rollout_engine`` or a protocol name with an engine's name); test files per package folder
(``tests/<folder>/``, or flat ``tests/`` files). ``--show`` prints lines, methods and parameters of
named places. ``--duplicates`` runs the tool library's ``duplicates`` over ``src`` and counts its pairs
(``make lint`` prints this table).
"""

from __future__ import annotations

import argparse
import ast
import re
import subprocess
from collections import Counter
from pathlib import Path

LONG_FUNCTION = 60
LONG_LINE = 120
LONG_MODULE = 600
ENGINE_NAMES = {"sglang", "vllm", "in-process"}


def _switches_on_engine_kind(tree: ast.AST) -> bool:
    """A comparison of ``rollout_engine`` (or a ``protocol``) with an engine's name, or any use of ``rollout_engine``
    in a condition."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = any(isinstance(n, ast.Constant) and n.value in ENGINE_NAMES for n in sides)
            subject = any(ast.unparse(n).endswith(("rollout_engine", "protocol")) for n in sides)
            if named and subject:
                return True
    return False


def _defs(tree: ast.AST, prefix: str = ""):
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            yield name, node
            yield from _defs(node, name + ".")


def _size(node: ast.AST) -> int:
    return node.end_lineno - node.lineno + 1


def _params(node: ast.AST) -> int:
    a = node.args
    names = [*a.posonlyargs, *a.args, *a.kwonlyargs]
    return len([n for n in names if n.arg not in ("self", "cls")]) + bool(a.vararg) + bool(a.kwarg)


def shape(root: Path) -> dict:
    src = root / "src" / "support_replay"
    files = sorted(src.rglob("*.py"))
    out = {"modules": len(files), "lines": 0, "long_lines": 0, "long_functions": [], "classes": [], "params": []}
    out["long_modules"], out["engine_switches"] = [], []
    places = {}
    for path in files:
        text = path.read_text()
        rel = path.relative_to(src).as_posix()
        out["lines"] += text.count("\n")
        out["long_lines"] += sum(len(line) > LONG_LINE for line in text.splitlines())
        if text.count("\n") > LONG_MODULE:
            out["long_modules"].append((text.count("\n"), rel))
        tree = ast.parse(text)
        if not rel.startswith("backends/") and _switches_on_engine_kind(tree):
            out["engine_switches"].append(rel)
        for name, node in _defs(tree):
            places[f"{rel}:{name}"] = node
            if isinstance(node, ast.ClassDef):
                methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
                out["classes"].append((_size(node), methods, f"{rel}:{name}"))
            else:
                out["params"].append((_params(node), f"{rel}:{name}"))
                if _size(node) > LONG_FUNCTION:
                    out["long_functions"].append((_size(node), f"{rel}:{name}"))
    out["places"] = places
    modules = {p.relative_to(src).parts[0] if len(p.relative_to(src).parts) > 1 else "(root)" for p in files}
    tests = Counter()
    for path in (root / "tests").rglob("test_*.py"):
        parts = path.relative_to(root / "tests").parts
        tests[parts[0] if len(parts) > 1 else "(flat)"] += 1
    out["tests"] = tests
    out["folders"] = sorted(modules)
    return out


def duplicate_pairs(root: Path) -> str:
    try:
        run = subprocess.run(
            ["duplicates", "--repo", str(root / "src"), "--seconds", "120"], capture_output=True, text=True, timeout=300
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"not run ({error})"
    first = run.stdout.splitlines()[0] if run.stdout else run.stderr.strip()
    return first


def describe(node: ast.AST) -> str:
    if isinstance(node, ast.ClassDef):
        methods = sum(isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in node.body)
        fields = sum(isinstance(n, ast.AnnAssign) for n in node.body)
        return f"{_size(node)} lines, {methods} methods, {fields} annotated fields"
    return f"{_size(node)} lines, {_params(node)} parameters"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[1])
    parser.add_argument("--show", nargs="*", default=[])
    parser.add_argument("--duplicates", action="store_true")
    args = parser.parse_args()
    s = shape(args.root)
    print("| measure | value |\n|---|---|")
    print(f"| modules | {s['modules']} |")
    print(f"| lines | {s['lines']} |")
    print(f"| lines over {LONG_LINE} characters | {s['long_lines']} |")
    print(f"| modules over {LONG_MODULE} lines | {len(s['long_modules'])} |")
    print(f"| functions over {LONG_FUNCTION} lines | {len(s['long_functions'])} |")
    print(f"| modules outside backends/ that switch on the engine kind | {len(s['engine_switches'])} |")
    tests = ", ".join(f"{k} {v}" for k, v in sorted(s["tests"].items()))
    print(f"| test files per folder | {tests} |")
    if args.duplicates:
        print(f"| duplicates (src) | {duplicate_pairs(args.root)} |")
    print(f"\nmodules over {LONG_MODULE} lines:")
    for size, name in sorted(s["long_modules"], reverse=True):
        print(f"  {size:4d}  {name}")
    if s["engine_switches"]:
        print("\nmodules that switch on the engine kind: " + ", ".join(s["engine_switches"]))
    print("\nfunctions over 60 lines:")
    for size, name in sorted(s["long_functions"], reverse=True):
        print(f"  {size:4d}  {name}")
    print("\nlargest classes (lines, methods):")
    for size, methods, name in sorted(s["classes"], reverse=True)[:5]:
        print(f"  {size:4d} {methods:3d}  {name}")
    print("\nmost parameters:")
    for count, name in sorted(s["params"], reverse=True)[:5]:
        print(f"  {count:4d}  {name}")
    for want in args.show:
        pattern = re.compile(re.escape(want).replace(r"\*", ".*") + "$")
        hits = [k for k in s["places"] if pattern.match(k)]
        for key in hits or [want]:
            node = s["places"].get(key)
            print(f"\n{key}: {describe(node) if node else 'not found'}")


if __name__ == "__main__":
    main()
