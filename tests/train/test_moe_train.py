"""GRPO on mixtures of experts with routing replay (R3): --ci-test per token in-process and through
``serve``, true-on-policy at tolerance 0 with and without R3, agents, and the fail-closed rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recipe_helpers import agent_config, run_config
from support_replay.backends.in_process import InProcessKind
from support_replay.errors import CITestError, ConfigError, SampleError
from support_replay.modeling.moe import routing_control
from support_replay.rollout.sample import Sample, check_sample_routing
from support_replay.train import train
from support_replay.train.actor import Actor
from support_replay.train.dist import DistContext

R3 = dict(use_rollout_routing_replay=True)


def assert_per_token(rows, exact: bool = False):
    for r in rows:
        if exact:
            assert r["train_rollout_logprob_abs_diff_max"] == 0.0 and r["train_rollout_unequal_tokens"] == 0
        assert 0.999 < r["replay_ratio_mean"] < 1.001


@pytest.mark.parametrize("packed", ["off", "on"])
def test_grpo_with_routing_replay_passes_ci_test_in_process(tiny_moe_checkpoint, tmp_path, packed):
    rows = train(run_config(tiny_moe_checkpoint, tmp_path, packed_scoring=packed, **R3))
    assert_per_token(rows)
    assert all(r["routing_agreement"] == 1.0 for r in rows)  # fp32 on both sides: the trainer routes alike


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_grpo_on_each_moe_family_with_routing_replay(family, request, tmp_path):
    checkpoint = request.getfixturevalue(f"tiny_{family}_checkpoint")
    rows = train(run_config(checkpoint, tmp_path, num_rollout=2, **R3))
    assert_per_token(rows)
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)


@pytest.fixture
def engine_routes_otherwise(monkeypatch):
    """The in-process engine's routers send every third token to another second expert (weighted by the router's
    own probability there): an engine whose routing differs from the trainer's, as a perturbed router's does."""
    connect = InProcessKind.connect

    def perturbed(kind, needs):
        backend = connect(kind, needs)
        model = kind.engine.runner.model
        control, experts = routing_control(model), model.config.num_experts
        choose = control.choose

        def otherwise(layer, own):
            other = own.clone()
            second = (own[::3, 1] + 1) % experts
            other[::3, 1] = torch.where(second == own[::3, 0], (second + 1) % experts, second)
            choose(layer, other)  # captured as what the engine ran
            return other

        control.choose = otherwise
        return backend

    monkeypatch.setattr(InProcessKind, "connect", perturbed)


def test_routing_replay_is_what_passes_ci_test_when_the_engine_routes_otherwise(
    tiny_moe_checkpoint, tmp_path, engine_routes_otherwise
):
    rows = train(run_config(tiny_moe_checkpoint, tmp_path / "r3", num_rollout=2, **R3))
    assert_per_token(rows)
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and r["routing_agreement"] < 0.8 for r in rows)
    with pytest.raises(CITestError, match="--ci-test failed at rollout 0"):
        train(run_config(tiny_moe_checkpoint, tmp_path / "own"))  # the trainer routes by itself


@pytest.mark.float_bits
@pytest.mark.parametrize("routing", [False, True], ids=["own-routing", "r3"])
def test_true_on_policy_on_a_moe_is_bitwise(tiny_moe_checkpoint, tmp_path, routing):
    rows = train(
        run_config(tiny_moe_checkpoint, tmp_path, true_on_policy_mode=True, num_rollout=2,
                   use_rollout_routing_replay=routing)
    )  # fmt: skip
    assert_per_token(rows, exact=True)


@pytest.mark.float_bits
@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe", "mixtral"])
def test_true_on_policy_is_bitwise_on_each_moe_family(family, request, tmp_path):
    checkpoint = request.getfixturevalue(f"tiny_{family}_checkpoint")
    rows = train(run_config(checkpoint, tmp_path, true_on_policy_mode=True, num_rollout=1, **R3))
    assert_per_token(rows, exact=True)


@pytest.mark.slow
def test_agent_episodes_replay_each_computation_s_routing(tmp_path):
    from tiny_model import build_tiny_moe_checkpoint

    checkpoint = build_tiny_moe_checkpoint(tmp_path / "moe-agents", max_positions=2048)
    rows = train(agent_config(checkpoint, tmp_path, agent="chain", **R3))
    assert_per_token(rows)
    assert all(0 <= r["routing_recomputed_flip_share"] <= 1 for r in rows)


def test_routing_replay_on_a_dense_model_is_refused(tiny_checkpoint):
    one = DistContext(rank=0, world=1, device="cpu", owns_group=False)
    with pytest.raises(ConfigError, match="--use-rollout-routing-replay: Qwen3ForCausalLM is a dense model"):
        Actor(tiny_checkpoint, one, lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, replay=True, full_with_grad=False,
              routing_replay=True)  # fmt: skip


def test_sample_routing_fails_closed_naming_sample_position_and_layer(tiny_moe_checkpoint):
    from transformers import AutoModelForCausalLM

    from support_replay.modeling.moe import routing_shape

    shape = routing_shape(AutoModelForCausalLM.from_pretrained(tiny_moe_checkpoint))
    rng = np.random.default_rng(0)
    good = np.argsort(rng.random((7, 2, 8)), -1)[..., :2].astype(np.int32)
    sample = Sample(3, 0, [1, 2, 3], [4, 5, 6, 7, 8], np.array([1, 1, 0, 0, 0], np.int8), routing=good)
    check_sample_routing(sample, shape)
    sample.routing = good.copy()
    sample.routing[4:] = -1  # after the last sampled token (position 4 predicts response token 2, inserted)
    check_sample_routing(sample, shape)
    cases = [
        (None, "sample 3: --use-rollout-routing-replay is on but the sample carries no routed experts"),
        (good[:-1], "sample 3: routing for 6 positions, expected 7"),
        (good[:, :1], "sample 3: routing for 1 layers, the model has 2"),
        (np.where(np.arange(2) == 0, 9, good), "sample 3: position 0 layer 0: expert id 9 outside \\[0, 8\\)"),
    ]
    for routed, match in cases:
        sample.routing = routed
        with pytest.raises(SampleError, match=match):
            check_sample_routing(sample, shape)
    sample.routing = good.copy()
    sample.routing[1] = -1
    with pytest.raises(SampleError, match="sample 3: position 1 has no routing, and a sampled token follows it"):
        check_sample_routing(sample, shape)
    with pytest.raises(SampleError, match="sample 3: --use-rollout-routing-replay on a dense model"):
        check_sample_routing(sample, None)


@pytest.mark.slow
def test_asynchronous_rollouts_replay_the_routing_of_the_version_that_sampled(tiny_moe_checkpoint, tmp_path):
    rows = train(run_config(tiny_moe_checkpoint, tmp_path, async_rollout=True, max_policy_lag=1, num_rollout=3, **R3))
    # --ci-test passed: a lagged token is scored under the weights and the routing that sampled it (the ratio
    # to the current policy, replay_ratio_mean, is off-policy by design here)
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)
    assert max(r["policy_lag_max"] for r in rows) == 1
