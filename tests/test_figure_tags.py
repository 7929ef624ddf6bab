"""Every measured figure of the README and the docs names the command that prints it.

A tag is an HTML comment after the table or sentence it covers, ``<!-- by: bench/faithfulness.py --prompts 32 -->``
(several commands separated by ``;``; ``arithmetic`` for a figure worked out from sizes the sentence states). The
check: each tagged command exists (a bench script, a `support-replay` command, a make target or a pytest test) with
each of its flags, and no block (a paragraph, a table, a list item) of the README or of a doc in ``TAGGED_DOCS``
that holds a figure lacks a tag. docs/benchmarks.md's dated tables carry their own command line.

``python tests/test_figure_tags.py`` lists the tags and the figures each covers.
"""

from __future__ import annotations

import re
import shlex
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
TAGGED = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TAG = re.compile(r"(?<!`)<!-- by: (.*?) -->", re.DOTALL)  # in inline code it is an example, not a tag

# A measured figure: a decimal, a share, a power of ten, a count with thousands, a time, a size, a factor.
FIGURE = re.compile(
    r"(?<![\w.])(?:\d+(?:\.\d+)?e-?\d+|\d+(?:\.\d+)?\s?%|\d{1,3}(?:,\d{3})+"
    r"|\d+(?:\.\d+)?\s?(?:s|ms|minutes?|seconds?|hours?|GB|MB|GiB|MiB)\b|\d+(?:\.\d+)?x\b|\d+\.\d+)"
)
# Not figures: settings written beside their name, intervals, versions, paper numbers, code.
SETTINGS = re.compile(
    r"`[^`]*`|\[[\d., ]+\]|\b\d+\.\d+\.\d+\b|arXiv \d+\.\d+|-9999\.0"
    r"|(?:SGLang|Ray|vLLM|vllm|smg|torch|Python)(?: other than|'s)? \(?\d+(?:\.[\dx]+)+"
    r"|\b(?:top_p|top_k|min_p|temperature|lr|repetition|frequency|presence|default)\s*=?\s*-?[\d.]+(?:e-?\d+)?"
    r"|--[\w-]+[ =]-?[\d.]+(?:e-?\d+)?"
)


def figures(text: str) -> list[str]:
    """The measured figures of a block of markdown, settings and code left out."""
    return FIGURE.findall(SETTINGS.sub(" ", TAG.sub(" ", text)))


def blocks(text: str) -> list[tuple[int, str]]:
    """``(first line, text)`` of each paragraph, table and list item outside fenced code; a tag on the line after a
    block belongs to it."""
    found, current, start, fenced = [], [], 0, False
    lines = text.splitlines()

    def close():
        if current:
            found.append((start, "\n".join(current)))
            current.clear()

    for number, line in enumerate(lines, 1):
        if line.startswith("```"):
            close()
            fenced = not fenced
            continue
        if fenced:
            continue
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            close()
        elif TAG.fullmatch(stripped) and found and not current:
            found[-1] = (found[-1][0], found[-1][1] + "\n" + stripped)  # the tag line after a blank-less block
        elif TAG.fullmatch(stripped) and current:
            current.append(stripped)
            close()
        else:
            starts_item = re.match(r"([-*]|\d+\.) ", stripped) and not (current and current[0].startswith("|"))
            if starts_item or (current and current[0].startswith("|") != stripped.startswith("|")):
                close()
            if not current:
                start = number
            current.append(line)
    close()
    return found


@cache
def _parser():
    from support_replay.cli import build_parser

    return build_parser()


def _subcommand_flags(name: str) -> set[str] | None:
    for action in _parser()._subparsers._group_actions:
        if name in action.choices:
            return set(action.choices[name]._option_string_actions)
    return None


def command_problems(command: str) -> list[str]:
    """What is wrong with one tagged command: a script, subcommand, target or flag that does not exist."""
    if command == "arithmetic":  # a figure worked out from sizes the sentence itself states
        return []
    words = shlex.split(command)
    if words and words[0] == "python":
        words = words[1:]
    if not words:
        return ["an empty command"]
    flags = {w.partition("=")[0] for w in words[1:] if w.startswith("--")}
    if words[0].startswith("bench/"):
        script = ROOT / words[0]
        if not script.is_file():
            return [f"{words[0]} does not exist"]
        source = script.read_text()
        return [f"{words[0]} has no flag {f}" for f in sorted(flags) if f'"{f}"' not in source]
    if words[0] == "support-replay":
        known = _subcommand_flags(words[1]) if len(words) > 1 else None
        if known is None:
            return [f"support-replay has no command {words[1:2]}"]
        return [f"support-replay {words[1]} has no flag {f}" for f in sorted(flags) if f not in known]
    if words[0] == "pytest":
        path, _, test = words[1].partition("::") if len(words) > 1 else ("", "", "")
        if not (ROOT / path).is_file() or not path.startswith("tests/"):
            return [f"{path or 'pytest'}: no such test file"]
        return [f"{path} has no test {test}"] if test and f"def {test}(" not in (ROOT / path).read_text() else []
    if words[0] == "make":
        targets = re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.MULTILINE)
        return [f"make has no target {t}" for t in words[1:] if "=" not in t and t not in targets]
    return [f"{command!r}: not a bench script, a support-replay command, a make target or a pytest test"]


def tags(text: str) -> list[tuple[int, str]]:
    """``(line, command)`` for every command of every tag."""
    return [
        (text.count("\n", 0, match.start()) + 1, command.strip())
        for match in TAG.finditer(text)
        for command in match.group(1).split(";")
    ]


def untagged(text: str) -> list[str]:
    """The blocks that hold a measured figure and no tag."""
    return [
        f"line {line}: {', '.join(figures(block))}: {block.splitlines()[0][:80]}"
        for line, block in blocks(text)
        if figures(block) and not TAG.search(block)
    ]


def test_every_tag_names_a_command_that_exists_with_its_flags():
    found = [
        f"{path.relative_to(ROOT)}:{line}: {problem}"
        for path in TAGGED
        for line, command in tags(path.read_text())
        for problem in command_problems(command)
    ]
    assert found == []


# Every doc but docs/benchmarks.md, whose dated tables carry their command line instead.
TAGGED_DOCS = sorted(p.stem for p in (ROOT / "docs").glob("*.md") if p.name != "benchmarks.md")


@pytest.mark.parametrize("name", ["README", *(f"docs/{d}" for d in TAGGED_DOCS)])
def test_every_figure_is_tagged(name):
    assert untagged((ROOT / f"{name}.md").read_text()) == []


def test_the_check_finds_an_untagged_figure_and_a_wrong_command():
    text = "Setup at top_p 0.8 and `--lr 2e-5`, SGLang 0.5.23.\n\nIt took 3.5 s and 12% of the tokens.\n"
    assert untagged(text) == ["line 3: 3.5 s, 12%: It took 3.5 s and 12% of the tokens."]
    assert untagged(text.replace("tokens.\n", "tokens. <!-- by: bench/demo.py -->\n")) == []
    table = "| a | b |\n|---|---:|\n| x | 0.870 |\n"
    assert untagged(table) and untagged(table + "<!-- by: bench/faithfulness.py -->\n") == []
    assert untagged("- one item, 5 minutes\n- another\n") == ["line 1: 5 minutes: - one item, 5 minutes"]
    assert command_problems("bench/faithfulness.py --prompts 32") == []
    assert command_problems("bench/faithfulness.py --no-such-flag") == [
        "bench/faithfulness.py has no flag --no-such-flag"
    ]
    assert command_problems("bench/nowhere.py") == ["bench/nowhere.py does not exist"]
    assert command_problems("support-replay train --rollout-top-p 0.8") == []
    assert command_problems("support-replay train --no-such-flag") == [
        "support-replay train has no flag --no-such-flag"
    ]
    assert command_problems("pytest tests/test_figure_tags.py::test_every_figure_is_tagged") == []
    assert command_problems("pytest tests/test_figure_tags.py::nothing") == [
        "tests/test_figure_tags.py has no test nothing"
    ]
    assert command_problems("make bench") == [] and command_problems("make nowhere") == ["make has no target nowhere"]


if __name__ == "__main__":
    for path in TAGGED:
        text = path.read_text()
        for line, block in blocks(text):
            for match in TAG.finditer(block):
                print(f"{path.relative_to(ROOT)}:{line}: {match.group(1)}: {', '.join(figures(block)) or '-'}")
