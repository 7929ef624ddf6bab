"""Every test that compares log-probs or logits exactly carries the ``float_bits`` marker, so that CI reruns it under
the other two kernel sets (Makefile, test-floats-other-kernels): a bitwise promise checked under one set only is the
promise of one CPU.

A comparison is exact where it is ``torch.equal`` / ``np.array_equal`` of something named like a log-prob or a logit,
an ``== 0.0`` of such a difference, the bf16 gradient's ulp bound, or a run in true-on-policy mode (whose --ci-test
compares every token at tolerance 0)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).parent
NAMED = re.compile(r"log_?mu|log_?pi|logp|logprob|logit|\blse\b|rollout_logprob_abs_diff|unequal_tokens|max_abs")
TRUE_ON_POLICY = re.compile(r"true_on_policy_mode=True|--true-on-policy-mode|deterministic=True")
EXACT_CALLS = {("torch", "equal"), ("np", "array_equal"), ("numpy", "array_equal")}
ULP_BOUNDS = {"assert_rounded_once"}


def _dotted(node: ast.AST) -> tuple[str, ...]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return tuple(reversed(parts))


def _marks_float_bits(node: ast.AST) -> bool:
    return any("float_bits" in _dotted(n) for n in ast.walk(node) if isinstance(n, ast.Attribute))


def _refusals(function: ast.FunctionDef) -> set[int]:
    """The lines inside ``with pytest.raises(...)`` blocks: settings there are refused, never run."""
    inside = set()
    for node in ast.walk(function):
        if isinstance(node, ast.With) and any(
            isinstance(item.context_expr, ast.Call) and _dotted(item.context_expr.func)[-1:] == ("raises",)
            for item in node.items
        ):
            inside.update(range(node.lineno, (node.end_lineno or node.lineno) + 1))
    return inside


def _segments(source: str):
    """``ast.get_source_segment`` over lines split once: it splits the whole source at every call, which made this
    scan of every test file take half a minute."""
    rows = [row.encode() for row in source.splitlines(keepends=True)]

    def segment(node: ast.AST) -> str:
        if getattr(node, "end_lineno", None) is None:
            return ""
        first, last = node.lineno - 1, node.end_lineno - 1
        if first == last:
            return rows[first][node.col_offset : node.end_col_offset].decode()
        inner = [rows[first][node.col_offset :], *rows[first + 1 : last], rows[last][: node.end_col_offset]]
        return b"".join(inner).decode()

    return segment


def exact_comparisons(function: ast.FunctionDef, source: str) -> list[int]:
    """Lines of ``function`` that compare log-probs or logits exactly."""
    lines = []
    segment = _segments(source)
    refused = _refusals(function)
    body = [node for statement in function.body for node in ast.walk(statement)]  # the decorators' settings: not run
    for node in body:
        if getattr(node, "lineno", None) in refused:
            continue
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name[-2:] in EXACT_CALLS and NAMED.search(segment(node)):
                lines.append(node.lineno)
            elif name and name[-1] in ULP_BOUNDS:
                lines.append(node.lineno)
        elif isinstance(node, ast.keyword | ast.Constant):
            text = segment(node)
            if TRUE_ON_POLICY.search(text) and not (isinstance(node, ast.Constant) and text.startswith('"""')):
                lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.Eq) for op in node.ops):
            zero = any(
                isinstance(c, ast.Constant) and c.value == 0.0 and isinstance(c.value, float) for c in node.comparators
            )
            if zero and NAMED.search(segment(node.left)):
                lines.append(node.lineno)
    return lines


def unmarked() -> list[str]:
    found = []
    for path in sorted(TESTS.rglob("test_*.py")):
        if path == Path(__file__):  # its own examples are strings
            continue
        source = path.read_text()
        tree = ast.parse(source)
        module_marked = any(
            isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets)
            and _marks_float_bits(node.value)
            for node in tree.body
        )
        if module_marked:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                if any(_marks_float_bits(d) for d in node.decorator_list):
                    continue
                for line in exact_comparisons(node, source):
                    found.append(f"{path.relative_to(TESTS.parent)}:{line} ({node.name})")
    return found


def test_every_exact_comparison_of_log_probs_or_logits_is_marked_float_bits():
    missing = unmarked()
    assert not missing, "exact float comparisons without @pytest.mark.float_bits:\n" + "\n".join(missing)


def test_the_scan_finds_an_unmarked_comparison():
    lines = [
        "def test_x():",
        "    assert torch.equal(logits, other)",
        "    assert r['train_rollout_logprob_abs_diff_max'] == 0.0",
        "    run(true_on_policy_mode=True)",
        "    with pytest.raises(ConfigError):",
        "        run(true_on_policy_mode=True)",
        "    assert torch.equal(ids, other_ids)",
    ]
    source = "\n".join(lines) + "\n"
    assert exact_comparisons(ast.parse(source).body[0], source) == [2, 3, 4]
