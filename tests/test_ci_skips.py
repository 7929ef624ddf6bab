"""Under CI=true a skip fails the run, at collection too (tests/ci_skips.py); without it a skip is a skip."""

pytest_plugins = ["pytester"]

MODULES = {
    "test_gone": 'import pytest\npytest.importorskip("no_such_module_here")\n\n\ndef test_x():\n    pass\n',
    "test_skipped": 'import pytest\n\n\ndef test_y():\n    pytest.skip("no engine venv")\n\n\n'
    + "def test_z():\n    pass\n",
}


def run(pytester, monkeypatch, ci: str):
    pytester.makepyfile(**MODULES)
    monkeypatch.setenv("CI", ci)
    return pytester.runpytest("-p", "ci_skips", "-p", "no:cacheprovider", "-rA")


def test_under_ci_a_skip_in_a_test_or_at_collection_fails_the_run(pytester, monkeypatch):
    result = run(pytester, monkeypatch, "true")
    assert result.ret != 0
    result.assert_outcomes(passed=1, failed=1, errors=1)
    text = result.stdout.str()
    assert "skipped under CI=true, where a skip fails (tests/ci_skips.py, ALLOWED_SKIPS)" in text
    assert "no_such_module_here" in text and "no engine venv" in text
    assert "INTERNALERROR" not in text  # the summary prints: the run fails by its outcomes, not by a crash


def test_without_ci_a_skip_is_a_skip(pytester, monkeypatch):
    result = run(pytester, monkeypatch, "false")
    assert result.ret == 0
    result.assert_outcomes(passed=1, skipped=2)
