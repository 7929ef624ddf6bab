"""Under ``CI=true`` a skip is a failure (registered by tests/conftest.py): a test skipped while it runs, and a module
skipped whole at collection (an ``importorskip``, a module-level ``pytest.skip``), are reported failed with the skip's
reason, so that a green run means the suite checked what it claims on that machine (.ci/run sets ``CI=true``)."""

import os

import pytest

# Skips allowed under CI=true, by a piece of their reason, and why each may stay. The target is none: in CI a skip
# for a reason of the machine (its CPU kind, a kernel that did not build, a missing engine venv or compiler) is a
# failure, since a green run must mean the suite checked what it claims on that machine.
ALLOWED_SKIPS: dict[str, str] = {}


def in_ci() -> bool:
    return os.environ.get("CI") == "true"


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)


def _allowed(reason: str) -> bool:
    return any(piece in reason for piece in ALLOWED_SKIPS)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI=true a skipped test is reported failed, naming the skip's reason (unless ``ALLOWED_SKIPS`` has it)."""
    report = yield
    if in_ci() and report.skipped and not hasattr(report, "wasxfail") and not _allowed(reason := _skip_reason(report)):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where a skip fails (tests/ci_skips.py, ALLOWED_SKIPS): {reason}"
    return report


@pytest.hookimpl(tryfirst=True)  # before the terminal's own hook files the report under its outcome
def pytest_collectreport(report):
    """A module skipped whole at collection (an ``importorskip``, a module-level skip) fails the same way."""
    if in_ci() and report.skipped and not _allowed(reason := _skip_reason(report)):
        report.outcome = "failed"
        report.longrepr = f"skipped under CI=true, where a skip fails (tests/ci_skips.py, ALLOWED_SKIPS): {reason}"
