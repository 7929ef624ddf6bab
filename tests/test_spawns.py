"""The ``processes`` marker is kept true by the run (tests/spawns.py): a test that starts a process of ours, or uses
a fixture that did, fails without it; a compiler is not counted; ``-m processes`` selects the marked tests."""

import pytest

pytest_plugins = ["pytester"]

INNER = """
import subprocess
import sys

import pytest


@pytest.fixture(scope="session")
def child():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_spawn():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.processes
def test_marked_spawn():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_a_tool_that_is_not_ours():
    subprocess.run(["true"], check=True)


@pytest.mark.processes
def test_first_user_of_the_fixture(child):
    pass


def test_later_user_of_the_fixture(child):
    pass
"""


@pytest.mark.processes  # the inner tests start Python children in this process
def test_a_test_that_starts_a_process_without_the_marker_fails_and_names_it(pytester):
    pytester.makepyfile(test_inner=INNER)
    result = pytester.runpytest_inprocess("-p", "spawns", "-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=3, failed=2)
    failed = {r.nodeid.split("::")[1]: str(r.longrepr) for r in result.reprec.getreports() if r.failed}
    assert set(failed) == {"test_unmarked_spawn", "test_later_user_of_the_fixture"}
    assert "started 1 process(es)" in failed["test_unmarked_spawn"] and "-c pass" in failed["test_unmarked_spawn"]
    assert "uses fixture(s) ['child'], which started processes" in failed["test_later_user_of_the_fixture"]

    selected = pytester.runpytest_inprocess("-p", "spawns", "-p", "no:cacheprovider", "-q", "-m", "processes")
    selected.assert_outcomes(passed=2, deselected=3)
