"""The suite's own tools: make test's phase table (tests/phases.py), the rerun script's reading of pytest's reports
(tests/rerun.py) and the static count of tests and checks (tests/suite_size.py)."""

from pathlib import Path

from phases import table
from rerun import outcomes
from suite_size import count


def test_the_phase_table_gives_each_phase_its_start_end_and_wall_and_names_one_that_never_ended():
    lines = [
        "begin 100.0 make test",
        "begin 100.5 installs: the main venv",
        "begin 101.0 installs: SGLang's venv",
        "end 190.5 installs: the main venv",
        "end 269.0 installs: SGLang's venv",
        "begin 270.0 main pass",
        "not a phase line",
    ]
    rows = table(lines)
    assert rows[0].startswith("make test: wall time per phase")
    by_name = {row.split("  ")[1].strip(): row.split() for row in rows[2:]}
    assert by_name["installs: the main venv"][-3:] == ["0", "90", "90"]  # start 0.5 s, end 90.5 s, 90 s
    assert by_name["installs: SGLang's venv"][-3:] == ["1", "169", "168"]
    unended = [row.split("  ")[1].strip() for row in rows[2:] if row.endswith("(not ended)")]
    assert unended == ["make test", "main pass"]  # begun and never ended, in the order they began
    assert table([]) == ["make test: no phase was recorded"]


def test_the_rerun_script_reads_each_test_s_outcome_and_first_message_line(tmp_path):
    report = tmp_path / "r.xml"
    report.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.train.test_a" name="test_ok[serve]" time="1"/>'
        '<testcase classname="tests.train.test_a" name="test_bad" time="1">'
        '<failure message="assert 0 &gt;= 1&#10;second line">trace</failure></testcase>'
        '<testcase classname="tests.test_b" name="test_skip" time="0"><skipped message="no vLLM"/></testcase>'
        '<testcase classname="tests.test_b" name="test_teardown" time="1"/>'
        '<testcase classname="tests.test_b" name="test_teardown" time="1"><error message="teardown broke"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert outcomes(report) == {
        "tests/train/test_a.py::test_ok[serve]": ("passed", ""),
        "tests/train/test_a.py::test_bad": ("failed", "assert 0 >= 1"),
        "tests/test_b.py::test_skip": ("skipped", "no vLLM"),
        "tests/test_b.py::test_teardown": ("error", "teardown broke"),  # passed, then errored at teardown
    }


def test_the_suite_size_counts_test_functions_and_every_kind_of_check():
    source = """
import numpy as np
import pytest

def helper():
    assert True  # a check outside a test function counts: it runs inside one

def test_one():
    assert 1 == 1
    with pytest.raises(ValueError):
        int("x")
    np.testing.assert_allclose([1.0], [1.0])

class TestTwo:
    def test_two(self):
        torch.testing.assert_close(a, b)
        assert_rows_equal(a, b)
        pytest.warns(UserWarning)
        other.raises(ValueError)  # not pytest's
"""
    assert count(source) == (2, 7)


def test_the_tools_are_under_tests():
    assert {p.name for p in Path(__file__).parent.glob("*.py")} >= {"phases.py", "rerun.py", "suite_size.py"}
