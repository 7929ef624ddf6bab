"""The ``processes`` marker: a test that starts processes of its own (a server, a router, an engine, a Ray cluster,
trainer ranks, a Python child) carries it, so that such tests can be selected (``-m processes``) and rerun under
load (``tests/rerun.py``).

Kept true by the run itself: every process started while a test is set up or runs is recorded (``subprocess`` and
``multiprocessing`` alike), and a test that started one, or that uses a fixture which did, fails if it lacks the
marker. A test gets the marker from ``pytestmark``, its own decorator, or from using a fixture named in
``PROCESS_FIXTURES`` (those that start processes for several tests: the session's real engines, the Ray cluster).
A compiler the kernels' builder runs is not a process of ours and is not counted."""

from __future__ import annotations

import multiprocessing.process
import os
import re
import subprocess
import sys

import pytest

MARKER = "processes"
# Fixtures that start processes (directly or through the fixtures they use): each test using one gets the marker.
PROCESS_FIXTURES = {
    "sglang_servers",
    "vllm_server",
    "cluster",
    "failed_starts",
    "two_engines_and_router",
    "fsdp_runs",
    "agent_runs",
}
# Executables that are ours or our engines' besides a Python interpreter (Ray's services, smg's binary).
OURS = {"raylet", "gcs_server", "smg", "torchrun", "support-replay", "ray"}

SPAWNED: list[str] = []  # the command lines started in this process, in order
FIXTURES_THAT_SPAWNED: set[str] = set()


SHELLS = {"bash", "sh"}


def _command(args) -> str:
    return os.fsdecode(args) if isinstance(args, (str, bytes)) else " ".join(map(os.fsdecode, args))


def _counted(executable, args) -> bool:
    """A Python interpreter, one of ``OURS``, or a shell that runs one of them."""
    command = _command(args)
    first = os.fsdecode(executable) if executable else command.split()[0] if command.split() else ""
    name = os.path.basename(first)
    if name in SHELLS:  # bash -c "... exec support-replay serve ...": what it runs
        return any(_ours(word) for word in re.split(r"[\s;&|()]+", command)[1:])
    return first == sys.executable or _ours(first)


def _ours(word: str) -> bool:
    name = os.path.basename(word)
    return name.startswith("python") or name in OURS


def _record_popen(original):
    def execute_child(self, args, executable, *rest, **kw):
        if _counted(executable, args):
            SPAWNED.append(_command(args))
        return original(self, args, executable, *rest, **kw)

    return execute_child


def _record_process(original):
    def start(self):
        SPAWNED.append(f"multiprocessing: {self.name}")
        return original(self)

    return start


def install() -> None:
    """Record every process this interpreter starts from now on (idempotent)."""
    if getattr(subprocess.Popen._execute_child, "records_spawns", False):
        return
    subprocess.Popen._execute_child = _record_popen(subprocess.Popen._execute_child)
    subprocess.Popen._execute_child.records_spawns = True
    multiprocessing.process.BaseProcess.start = _record_process(multiprocessing.process.BaseProcess.start)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        f"{MARKER}: starts processes of its own (a server, router, engine, Ray cluster, trainer ranks, a Python child);"
        " tests/rerun.py reruns them",
    )
    install()


def pytest_collection_modifyitems(config, items):
    for item in items:
        if PROCESS_FIXTURES & set(item.fixturenames) and not item.get_closest_marker(MARKER):
            item.add_marker(MARKER)


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    before = len(SPAWNED)
    try:
        return (yield)
    finally:
        if len(SPAWNED) > before:
            FIXTURES_THAT_SPAWNED.add(fixturedef.argname)


_FIRST = pytest.StashKey[int]()  # where a test's own entries in SPAWNED begin


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_FIRST] = len(SPAWNED)
    return (yield)


def unmarked_spawns(item) -> str | None:
    """Why ``item`` should carry the marker and does not, or None."""
    if item.get_closest_marker(MARKER):
        return None
    started = SPAWNED[item.stash.get(_FIRST, len(SPAWNED)) :]
    if started:
        return f"started {len(started)} process(es) ({started[0][:160]})"
    fixtures = sorted(FIXTURES_THAT_SPAWNED & set(item.fixturenames))
    if fixtures:
        return f"uses fixture(s) {fixtures}, which started processes"
    return None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """After a test has run, one that started processes without the marker fails, naming what it started."""
    report = yield
    if call.when == "call" and report.passed and (why := unmarked_spawns(item)):
        report.outcome = "failed"
        report.longrepr = (
            f"{item.nodeid} {why} without the `{MARKER}` marker: mark it, or name its fixture in "
            "tests/spawns.py PROCESS_FIXTURES, so that `-m processes` selects it (tests/rerun.py)"
        )
    return report
