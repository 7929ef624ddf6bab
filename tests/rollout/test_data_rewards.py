import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support_replay import SupportReplayError
from support_replay.rollout import ArithmeticTask, load_prompts, load_reward, math_reward
from support_replay.rollout.rewards import final_answer


def test_math_reward():
    assert final_answer("so the answer is \\boxed{42}.") == "42"
    assert final_answer("12 + 7 = 19") == "19"
    assert math_reward("", "The answer is 19.", "19") == 1.0
    assert math_reward("", "The answer is 19.0", "19") == 1.0
    assert math_reward("", "I think 18", "19") == 0.0
    assert math_reward("", "no number here", "19") == 0.0
    assert math_reward("", "1,024", "1024") == 1.0


def test_arithmetic_task_is_deterministic_and_correct():
    task = ArithmeticTask(seed=3)
    p = task[5]
    assert task[5] == p and task[6] != p
    question = p.content[0]["content"]
    a, op, b = question.split("What is ")[1].split("?")[0].split()
    assert str(eval(f"{a}{op}{b}")) == p.label


def test_jsonl_and_parquet_prompts(tmp_path):
    rows = [{"q": "What is 1+1?", "a": 2}, {"q": [{"role": "user", "content": "hi"}], "a": "x"}]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    data = load_prompts(str(jsonl), "q", "a")
    assert len(data) == 2 and data[0].content == "What is 1+1?" and data[0].label == "2"
    assert data[3].content == rows[1]["q"]  # cycles
    parquet = tmp_path / "p.parquet"
    pq.write_table(pa.Table.from_pylist([{"q": "a", "a": "1"}]), parquet)
    assert load_prompts(str(parquet), "q", "a")[0].label == "1"
    with pytest.raises(SupportReplayError, match="row 0: no field 'prompt'"):
        load_prompts(str(jsonl), "prompt", "a")
    jsonl.write_text("{bad\n")
    with pytest.raises(SupportReplayError, match="p.jsonl:1: not valid JSON"):
        load_prompts(str(jsonl), "q", "a")


def test_custom_reward_loading():
    assert load_reward(None, "rewards_for_tests:digit_share")("", "a1", None) == 0.5
    assert load_reward("math", None) is math_reward
    with pytest.raises(SupportReplayError, match="--custom-rm-path='nope:x'"):
        load_reward(None, "nope:x")


MATH_VERIFY_TABLE = [
    # (label, response, reward): LaTeX fractions, \boxed{}, plain numbers, units, wrong answers
    ("\\frac{1}{2}", "so the answer is $\\boxed{\\frac{1}{2}}$", 1.0),
    ("\\frac{1}{2}", "the probability is 0.5", 1.0),
    ("3/4", "We get \\boxed{\\dfrac{3}{4}}.", 1.0),
    ("42", "12 + 30 = 42", 1.0),
    ("42", "The answer is \\boxed{42}", 1.0),
    ("10", "The total is $10 dollars.", 1.0),
    ("\\sqrt{2}", "the side is $\\sqrt{2}$", 1.0),
    ("42", "I think it is 41", 0.0),
    ("\\frac{1}{2}", "\\boxed{\\frac{1}{3}}", 0.0),
    ("7", "no number at all", 0.0),
    (None, "\\boxed{7}", 0.0),
]


@pytest.mark.parametrize("label, response, reward", MATH_VERIFY_TABLE)
def test_math_verify_reward(label, response, reward):
    pytest.importorskip("math_verify")
    fn = load_reward("math-verify", None)
    assert fn("prompt", response, label) == reward


def test_math_verify_runs_off_the_main_thread_too():
    """Asynchronous rollouts reward on a background thread, where math-verify has no signal-based timeout."""
    pytest.importorskip("math_verify")
    import threading

    fn, got = load_reward("math-verify", None), []
    worker = threading.Thread(target=lambda: got.append(fn("p", "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}")))
    worker.start()
    worker.join()
    assert got == [1.0]


def test_math_verify_not_installed_is_refused_by_name(monkeypatch):
    import sys

    from support_replay.errors import ConfigError

    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(ConfigError, match="--rm-type=math-verify: the math-verify package is not installed"):
        load_reward("math-verify", None)
