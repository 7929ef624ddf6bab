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
