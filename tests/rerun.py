"""Rerun selected tests N times, unloaded and beside a busy core, and print runs and failures per test.

    .venv/bin/python tests/rerun.py                          # every `processes` test, 10 times each way
    .venv/bin/python tests/rerun.py -n 3 --load busy -- -k partial_rollout tests/train

What follows ``--`` is pytest's selection (default ``-m processes``: the tests that start servers, routers, engines,
a Ray cluster or trainer ranks; tests/spawns.py). "busy" runs each pass beside a process spinning on one core (the
machine's other work, a noisy neighbour), which is how a race with the machine's speed shows on a 2-core machine.
Each pass is one pytest run; the table counts each test's runs and failures, and the failures' first lines follow.
Exits 1 if any run failed."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def busy_core(busy: bool):
    """A process spinning on core 0 for the block (nothing where ``busy`` is false)."""
    if not busy:
        yield
        return
    spin = "import os\ntry:\n    os.sched_setaffinity(0, {0})\nexcept OSError:\n    pass\nwhile True:\n    pass\n"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        yield
    finally:
        proc.kill()
        proc.wait()


def outcomes(junit: Path) -> dict[str, tuple[str, str]]:
    """``{test id: (outcome, first line of its message)}`` from a pytest JUnit report."""
    results = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test = f"{module}.py::{case.get('name')}" if module else case.get("name")
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            found = case.find(tag)
            if found is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                message = (found.get("message") or found.text or "").strip().splitlines()[:1]
                message = message[0][:200] if message else ""
                break
        # a test failed at call and errored at teardown reports twice: the worse outcome stands
        if test not in results or results[test][0] == "passed":
            results[test] = (outcome, message)
    return results


def one_pass(selection: list[str], junit: Path, busy: bool) -> tuple[dict, float, int]:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", *selection]
    start = time.monotonic()
    with busy_core(busy):
        done = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds = time.monotonic() - start
    if not junit.exists():
        sys.exit(f"rerun: pytest wrote no report (exit {done.returncode}):\n{done.stdout[-3000:]}")
    return outcomes(junit), seconds, done.returncode


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-n", "--times", type=int, default=10, help="passes per load (default 10)")
    parser.add_argument("--load", choices=("unloaded", "busy", "both"), default="both")
    parser.add_argument("selection", nargs="*", help="pytest's arguments after -- (default: -m processes)")
    args = parser.parse_args(argv)
    selection = args.selection or ["-m", "processes"]
    loads = {"unloaded": [False], "busy": [True], "both": [False, True]}[args.load]

    runs: dict[str, dict[bool, list[str]]] = defaultdict(lambda: {False: [], True: []})
    messages: dict[str, list[str]] = defaultdict(list)
    with tempfile.TemporaryDirectory(prefix="rerun-") as tmp:
        for busy in loads:
            for i in range(args.times):
                results, seconds, code = one_pass(selection, Path(tmp) / f"{busy}-{i}.xml", busy)
                failed = [t for t, (o, _) in results.items() if o != "passed"]
                label = "busy" if busy else "unloaded"
                print(
                    f"pass {i + 1}/{args.times} {label}: {len(results) - len(failed)} passed, {len(failed)} not"
                    f" (exit {code}) in {seconds:.0f} s",
                    flush=True,
                )
                for test, (outcome, message) in results.items():
                    runs[test][busy].append(outcome)
                    if outcome != "passed":
                        messages[test].append(f"{label} pass {i + 1}: {outcome}: {message}")

    width = max([len(t) for t in runs] + [4])
    columns = "".join(f" | {'busy' if b else 'unloaded'} runs, failures" for b in loads)
    print(f"\n{'test':<{width}}{columns}")
    for test in sorted(runs):
        cells = ""
        for busy in loads:
            seen = runs[test][busy]
            cells += f" | {len(seen):>14}, {sum(o != 'passed' for o in seen):>8}"
        print(f"{test:<{width}}{cells}")
    total_runs = sum(len(v) for r in runs.values() for v in r.values())
    total_failed = sum(o != "passed" for r in runs.values() for v in r.values() for o in v)
    print(f"\n{len(runs)} tests, {total_runs} runs, {total_failed} not passed")
    for test, lines in sorted(messages.items()):
        print(f"\n{test}:")
        for line in lines:
            print(f"  {line}")
    return 1 if total_failed else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
