"""bf16 rollouts and training (--rollout-dtype, --train-dtype): replay stays exact in what it
promises (the support and log mu as sampled), the --ci-test tolerance follows the dtypes."""

import pytest
import torch

from recipe_helpers import run_config
from support_replay.errors import CITestError, ConfigError
from support_replay.train import train
from support_replay.train.config import BF16_CI_TOLERANCE, FP32_CI_TOLERANCE


@pytest.mark.float_bits
def test_the_default_tolerance_follows_the_dtypes_and_a_given_one_wins(tiny_checkpoint, tmp_path):
    assert run_config(tiny_checkpoint, tmp_path).ci_tolerance == FP32_CI_TOLERANCE
    assert run_config(tiny_checkpoint, tmp_path, train_dtype="bfloat16").ci_tolerance == BF16_CI_TOLERANCE
    assert run_config(tiny_checkpoint, tmp_path, rollout_dtype="bfloat16", ci_test_tolerance=0.2).ci_tolerance == 0.2
    assert run_config(tiny_checkpoint, tmp_path, true_on_policy_mode=True).ci_tolerance == 0.0


@pytest.mark.float_bits
def test_true_on_policy_mode_runs_one_dtype_on_both_sides(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="--train-dtype='float32': true-on-policy mode computes the same bits"):
        run_config(tiny_checkpoint, tmp_path, true_on_policy_mode=True, rollout_dtype="bfloat16")
    config = run_config(tiny_checkpoint, tmp_path, true_on_policy_mode=True, rollout_dtype="bfloat16",
                        train_dtype="bfloat16")  # fmt: skip
    assert config.ci_tolerance == 0.0


def test_grpo_in_bf16_passes_ci_test_at_the_bf16_tolerance(tiny_checkpoint, tmp_path, capsys):
    rows = train(run_config(tiny_checkpoint, tmp_path, rollout_dtype="bfloat16", train_dtype="bfloat16", num_rollout=2))
    assert (
        f"every token within {BF16_CI_TOLERANCE:g} of its log mu (rollout bfloat16, trainer bfloat16)"
        in capsys.readouterr().out
    )
    assert all(r["train_rollout_logprob_abs_diff_max"] <= BF16_CI_TOLERANCE for r in rows)
    assert (
        rows[0]["train_rollout_logprob_abs_diff_max"] > 0
    )  # bf16 on both sides: not the same bits (a later rollout may be all singletons)
    # the support is what the bf16 engine realized; fp32 would differ: the check is not vacuous
    with pytest.raises(CITestError, match="--ci-test failed"):
        train(
            run_config(
                tiny_checkpoint,
                tmp_path / "tight",
                rollout_dtype="bfloat16",
                train_dtype="bfloat16",
                num_rollout=1,
                ci_test_tolerance=1e-3,
            )
        )


def test_bf16_training_keeps_fp32_weights(tiny_checkpoint, tmp_path):
    from support_replay.train.actor import Actor
    from support_replay.train.dist import DistContext

    one = DistContext(rank=0, world=1, device=torch.device("cpu"), owns_group=False)
    actor = Actor(
        tiny_checkpoint,
        one,
        lr=1e-3,
        betas=(0.9, 0.98),
        weight_decay=0.0,
        replay=True,
        full_with_grad=False,
        compute_dtype=torch.bfloat16,
    )
    assert {p.dtype for p in actor.model.parameters()} == {torch.float32}
