"""docs/benchmarks.md is a reference: one current table per (benchmark, CPU kind), each with its machine, date and
a command whose script exists; no table outside a benchmark's CPU-kind section."""

import re
from pathlib import Path

ROOT = Path(__file__).parents[1]
DOC = ROOT / "docs" / "benchmarks.md"
CPU_KINDS = {"AMD EPYC Zen 3", "AMD EPYC Zen 4", "AMD EPYC Zen 5", "Intel Xeon"}
INTRO_TABLES = 1  # the CPU kinds, before the first benchmark


def tables(lines: list[str]) -> list[int]:
    """The line numbers where a markdown table starts (a header row followed by its separator)."""
    return [
        i
        for i in range(len(lines) - 1)
        if lines[i].startswith("|") and re.match(r"\|\s*:?-", lines[i + 1]) and not lines[i - 1].startswith("|")
    ]


def sections(lines: list[str]):
    """``(benchmark, cpu kind, its lines)`` for every ``###`` under a ``##``; ``(None, None, lines)`` for the intro."""
    benchmark, cpu, start = None, None, 0
    for i, line in enumerate([*lines, "## end"]):
        if line.startswith("## ") or line.startswith("### "):
            yield benchmark, cpu, lines[start:i]
            start = i
            if line.startswith("## "):
                benchmark, cpu = line[3:].strip(), None
            else:
                cpu = line[4:].strip()


def problems(text: str) -> list[str]:
    lines, seen, found = text.splitlines(), set(), []
    for benchmark, cpu, body in sections(lines):
        count = len(tables(body))
        if benchmark is None:
            if count != INTRO_TABLES:
                found.append(f"the introduction holds {count} tables")
            continue
        where = f"{benchmark!r} / {cpu!r}"
        if cpu is None:
            if count:
                found.append(f"{benchmark!r}: a table outside a CPU kind's section")
            continue
        if cpu not in CPU_KINDS:
            found.append(f"{where}: not a CPU kind of the introduction's table")
        if (benchmark, cpu) in seen:
            found.append(f"{where}: a second section for this benchmark and CPU kind")
        seen.add((benchmark, cpu))
        if count != 1:
            found.append(f"{where}: {count} tables (one current table each)")
        machine = next((line for line in body if line.startswith("Machine: ")), "")
        if not re.search(r"Date: \d{4}-\d{2}-\d{2}", machine):
            found.append(f"{where}: no 'Machine: ... Date: YYYY-MM-DD' line")
        commands = re.findall(r"`([^`]+)`", machine.partition("Command")[2])
        if not commands:
            found.append(f"{where}: no 'Command: `...`' on its machine line")
        for command in commands:
            for script in re.findall(r"bench/[\w/]+\.py", command):
                if not (ROOT / script).exists():
                    found.append(f"{where}: {script} does not exist")
    return found


HELPERS = {"timing", "support_stream"}  # modules bench scripts import (the call timer, the support sizes drawn)


def commanded_scripts(text: str) -> set[str]:
    """The bench scripts named in a command on a table's machine line."""
    named = set()
    for line in text.splitlines():
        if line.startswith("Machine: "):
            for command in re.findall(r"`([^`]+)`", line.partition("Command")[2]):
                named.update(re.findall(r"bench/(\w+)\.py", command))
    return named


def test_every_bench_script_is_a_benchmark_with_a_table():
    """bench/ holds benchmarks, each the command of a current table; a probe whose point is what it asserts is a
    test instead (docs/reliability.md names each promise's test)."""
    sources = {path.stem: path.read_text() for path in (ROOT / "bench").glob("*.py")}
    for helper in HELPERS:  # a helper no script imports is a script without its table
        assert any(re.search(rf"^from {helper} import", text, re.MULTILINE) for text in sources.values()), helper
    assert sorted(set(sources) - HELPERS - commanded_scripts(DOC.read_text())) == []


def test_benchmarks_doc_holds_one_current_table_per_benchmark_and_cpu_kind():
    assert problems(DOC.read_text()) == []


def test_the_check_finds_a_second_table_a_missing_command_and_an_unknown_script():
    one = (
        "# B\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n## X\n\n### AMD EPYC Zen 4\n\n"
        "Machine: m. Date: 2026-12-05. Command: `python bench/wire.py`.\n\n| a |\n|---|\n| 1 |\n"
    )
    assert problems(one) == []
    twice = (
        one + "\n### AMD EPYC Zen 4\n\nMachine: m. Date: 2026-12-05. Command: `python bench/wire.py`.\n\n| a |\n|---|\n"
    )
    assert any("a second section" in p for p in problems(twice))
    assert any("no 'Command" in p for p in problems(one.replace("Command: `python bench/wire.py`", "")))
    assert any("bench/nowhere.py does not exist" in p for p in problems(one.replace("wire.py", "nowhere.py")))
    assert any("2 tables" in p for p in problems(one + "\n| c |\n|---|\n"))
