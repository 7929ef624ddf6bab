"""reasoning-gym tasks as prompts and their scorers as the reward, and a few GRPO steps on one with --ci-test."""

import json

import pytest

from support_replay.errors import ConfigError
from support_replay.rollout import load_prompts, load_reward
from support_replay.train.config import RunConfig

pytest.importorskip("reasoning_gym")


def test_a_task_gives_chat_prompts_whose_own_scorer_is_the_reward():
    task = load_prompts("reasoning_gym:basic_arithmetic", "input", "label", seed=3)
    prompt = task[5]
    system, user = prompt.content
    assert system["role"] == "system" and "<answer>" in system["content"] and user["role"] == "user"
    assert json.loads(prompt.label) == {"task": "basic_arithmetic", "seed": 3, "index": 5}
    assert load_prompts("reasoning_gym:basic_arithmetic", "input", "label", seed=3)[5] == prompt  # offline, seeded
    import reasoning_gym

    answer = reasoning_gym.create_dataset("basic_arithmetic", seed=3, size=2**31 - 1)[5]["answer"]
    reward = load_reward("reasoning_gym", None)
    assert reward("", f"Let me think.\n<answer>{answer}</answer>", prompt.label) == 1.0
    assert reward("", f"so the result is\n{answer}", prompt.label) == 1.0  # no tags: the last line
    assert reward("", "<answer>not a number</answer>", prompt.label) == 0.0


def test_unknown_tasks_and_mismatched_rewards_are_refused_by_name():
    with pytest.raises(ConfigError, match="--prompt-data=reasoning_gym:no_such_task: Dataset 'no_such_task'"):
        load_prompts("reasoning_gym:no_such_task", "input", "label")
    with pytest.raises(
        ConfigError, match="--prompt-data='reasoning_gym:leg_counting': .* give --rm-type reasoning_gym"
    ):
        RunConfig(prompt_data="reasoning_gym:leg_counting")
    with pytest.raises(ConfigError, match="--rm-type='reasoning_gym': scores reasoning-gym prompts"):
        RunConfig(rm_type="reasoning_gym")
    with pytest.raises(ConfigError, match="not a reasoning-gym prompt's"):
        load_reward("reasoning_gym", None)("", "x", "42")


def test_grpo_on_a_reasoning_gym_task_with_ci_test(tiny_agent_checkpoint, tmp_path):
    from recipe_helpers import run_config
    from support_replay.train import train

    rows = train(
        run_config(  # the tiny model with room for the system prompt (2,048 positions)
            tiny_agent_checkpoint,
            tmp_path,
            num_rollout=2,
            prompt_data="reasoning_gym:leg_counting",
            rm_type="reasoning_gym",
            custom_rm_path=None,
        )
    )
    assert len(rows) == 2 and all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)
    assert all(0.0 <= r["reward_mean"] <= 1.0 for r in rows)
