"""GRPO on agent episodes: both built-in environments with --ci-test (model tokens within the
tolerance, inserted tokens at exactly 0 on both sides and out of the loss), true-on-policy
bitwise on multi-turn trajectories, Miles' agent signature, history splits and failed
episodes in the trainer."""

import numpy as np
import pytest

from recipe_helpers import agent_config
from support_replay.train import train


@pytest.mark.parametrize("agent", ["chain", "calculator"])
def test_grpo_on_a_builtin_environment_with_ci_test(tiny_agent_checkpoint, tmp_path, scored, agent):
    rows = train(agent_config(tiny_agent_checkpoint, tmp_path, agent=agent, eval_interval=2, n_eval_prompts=2))
    assert len(rows) == 2 and all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)
    assert (
        0 <= rows[1]["eval_reward_mean"] <= 1 and "eval_reward_mean" not in rows[0]
    )  # the same agent, capture off, greedy
    inserted_tokens = 0
    for samples, logp in scored:
        for s, lp in zip(samples, logp):
            inserted = s.loss_mask == 0
            inserted_tokens += int(inserted.sum())
            assert np.all(s.log_mu[inserted] == 0) and np.all(lp.numpy()[inserted] == 0.0)  # exactly, both sides
            assert np.all(s.support.sizes()[inserted] == 1)
    if agent == "chain":  # the environment answers every turn
        assert inserted_tokens > 0 and rows[0]["episode_turns_mean"] > 1 and rows[0]["inserted_token_share"] > 0
    else:  # the system turn lists the tool; the random model does not call it
        assert "<tools>" in scored[0][0][0].prompt_text


@pytest.mark.float_bits
def test_true_on_policy_is_bitwise_on_multi_turn_trajectories(tiny_agent_checkpoint, tmp_path):
    rows = train(agent_config(tiny_agent_checkpoint, tmp_path, agent="chain", true_on_policy_mode=True))
    for r in rows:
        assert r["episode_turns_mean"] > 1
        assert r["train_rollout_logprob_abs_diff_max"] == 0.0 and r["train_rollout_unequal_tokens"] == 0


def test_an_agent_in_miles_signature_runs_unchanged(tiny_agent_checkpoint, tmp_path, scored):
    rows = train(
        agent_config(
            tiny_agent_checkpoint,
            tmp_path,
            agent_path="agents_for_tests.miles_style",
            custom_rm_path="rewards_for_tests:digit_share",
            num_rollout=1,
        )
    )
    samples = scored[0][0]
    assert rows[0]["episode_turns_mean"] == 2 and all(s.metadata["agent"] == "miles_style" for s in samples)
    from rewards_for_tests import digit_share

    # the run's reward function scored the finished trajectory: its last assistant message
    assert [s.reward for s in samples] == [digit_share("", s.metadata["final_message"], None) for s in samples]
    assert all(s.metadata["final_message"] in s.response_text for s in samples)


def test_history_rewrites_split_episodes_and_the_advantage_follows_the_episode(tiny_agent_checkpoint, tmp_path, scored):
    rows = train(
        agent_config(
            tiny_agent_checkpoint,
            tmp_path,
            agent_path="agents_for_tests:rewriter",
            custom_rm_path="rewards_for_tests:digit_share",
            num_rollout=1,
        )
    )
    samples = scored[0][0]
    assert rows[0]["split_samples"] == 4 and len(samples) == 8 and rows[0]["optimizer_steps"] == 2
    for a, b in zip(samples[::2], samples[1::2]):
        assert a.metadata["episode"] == b.metadata["episode"] and (a.metadata["segment"], b.metadata["segment"]) == (
            0,
            1,
        )
        assert (
            a.reward == b.reward and "history check: messages[1] (assistant) differs" in b.metadata["splits"][0]["why"]
        )


def test_history_rewrites_fail_the_episode_under_reject(tiny_agent_checkpoint, tmp_path):
    from support_replay.errors import EngineUnavailable

    with pytest.raises(
        EngineUnavailable,
        match=r"409 - session \w+, turn 1: history check: messages\[1\] \(assistant\) differs.*history_policy=reject",
    ):
        train(
            agent_config(
                tiny_agent_checkpoint,
                tmp_path,
                agent_path="agents_for_tests:rewriter",
                custom_rm_path="rewards_for_tests:digit_share",
                num_rollout=1,
                session_history_policy="reject",
                max_regenerations=0,
            )
        )


def test_a_failed_episode_regenerates_its_group(tiny_agent_checkpoint, tmp_path):
    import agents_for_tests

    agents_for_tests.ATTEMPTS.clear()
    rows = train(
        agent_config(
            tiny_agent_checkpoint,
            tmp_path,
            agent_path="agents_for_tests:flaky",
            custom_rm_path="rewards_for_tests:digit_share",
            num_rollout=1,
        )
    )
    assert (
        rows[0]["failed_samples"] == 1
        and rows[0]["regenerated_groups"] == 1
        and rows[0]["train_rollout_logprob_abs_diff_max"] <= 1e-3
    )


def test_a_harness_that_names_its_conversations_trains_one_group_per_task(tiny_agent_checkpoint, tmp_path, scored):
    rows = train(
        agent_config(
            tiny_agent_checkpoint,
            tmp_path,
            agent_path="agents_for_tests:harness_group",
            n_samples_per_prompt=3,
            global_batch_size=6,
            custom_rm_path="rewards_for_tests:digit_share",
            num_rollout=1,
            ci_test=True,
        )
    )
    samples = scored[0][0]
    from rewards_for_tests import digit_share

    assert rows[0]["episode_turns_mean"] == 2 and rows[0]["train_rollout_logprob_abs_diff_max"] <= 1e-3
    by_group: dict = {}
    for s in samples:
        by_group.setdefault(s.group, []).append(s)
    for group in by_group.values():  # one sample per X-Session-ID, in order of first sight within its task
        traces = sorted(s.metadata["client_session_id"] for s in group)
        assert traces == [f"trace-{k}" for k in range(len(group))]
        for s in group:
            trace = s.metadata["client_session_id"]
            expected = {"trace-0": 0.25, f"trace-{len(group) - 1}": 0.75}.get(
                trace, digit_share("", s.metadata["final_message"], None)
            )
            assert s.reward == expected and s.metadata["splits"] == []


def test_ci_test_passes_on_agents_that_force_tool_calls(tiny_agent_checkpoint, tmp_path, scored):
    rows = train(
        agent_config(
            tiny_agent_checkpoint,
            tmp_path,
            agent_path="agents_for_tests:forced_tool_call",
            chat_template="hermes_tools",
            num_rollout=1,
        )
    )
    samples = scored[0][0]
    assert rows[0]["train_rollout_logprob_abs_diff_max"] <= 1e-3 and rows[0]["episode_turns_mean"] == 2
    assert all(s.reward == 1.0 and s.metadata["splits"] == [] for s in samples)  # the call rendered back unchanged
    assert all('<tool_call>\n{"name": "calculator", "arguments": {"expression": "' in s.response_text for s in samples)
