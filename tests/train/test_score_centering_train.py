"""GRPO with score centering: --ci-test per token in-process, packed, with penalties, in true-on-policy
mode, through `serve`, on agents and under a policy lag of 1; the drift metric; the config's rules."""

from __future__ import annotations

import pytest

from processes import engine_process
from recipe_helpers import agent_config, run_config
from support_replay.errors import ConfigError
from support_replay.train import train

SC = dict(policy_loss="reinforce", use_score_centering=True)


def assert_per_token(rows, exact: bool = False):
    for r in rows:
        assert r["train_rollout_logprob_abs_diff_max"] <= (0.0 if exact else 1e-3)
        assert r["score_centering_drift"] >= 0


@pytest.mark.parametrize(
    "extra",
    [
        dict(score_centering_weight="none"),
        dict(score_centering_weight="tis", tis_cap=1.5, packed_scoring="on"),
        dict(score_centering_weight="mis", tis_cap=1.5, rollout_repetition_penalty=1.2, rollout_presence_penalty=0.3),
    ],
    ids=["w=1", "tis-packed", "mis-penalties"],
)
def test_grpo_with_score_centering_passes_ci_test(tiny_checkpoint, tmp_path, extra):
    rows = train(run_config(tiny_checkpoint, tmp_path, **SC, **extra))
    assert_per_token(rows)
    assert any(r["score_centering_drift"] > 0 for r in rows)  # groups with a nonzero advantage see the drift


@pytest.mark.float_bits
def test_true_on_policy_with_score_centering_is_bitwise(tiny_checkpoint, tmp_path):
    rows = train(run_config(tiny_checkpoint, tmp_path, true_on_policy_mode=True, num_rollout=2, **SC))
    assert_per_token(rows, exact=True)


def test_centering_changes_the_update_and_ratio_weights_make_it_vanish(tiny_checkpoint, tmp_path):
    """w = 1: the centred update differs from the plain one; w = p/q: E_p[s] = 0 on the support, so the
    term has no gradient and the run is the plain reinforce run, update for update."""
    one = dict(num_rollout=2, policy_loss="reinforce")
    plain = train(run_config(tiny_checkpoint, tmp_path / "plain", **one))
    centred = train(run_config(tiny_checkpoint, tmp_path / "centred", use_score_centering=True, **one))
    assert [r["grad_norm"] for r in plain] != [r["grad_norm"] for r in centred]
    ratio = dict(one, score_centering_weight="ratio")
    plain_r = train(run_config(tiny_checkpoint, tmp_path / "plain-r", **ratio))
    centred_r = train(run_config(tiny_checkpoint, tmp_path / "centred-r", use_score_centering=True, **ratio))
    for a, b in zip(plain_r, centred_r):
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5) and b["score_centering_drift"] < 1e-5


@pytest.mark.slow
@pytest.mark.processes
def test_score_centering_through_serve(tiny_checkpoint, tmp_path):
    ctx, url = engine_process(tiny_checkpoint)
    with ctx:
        rows = train(run_config(tiny_checkpoint, tmp_path, rollout_url=url, score_centering_weight="tis", **SC))
    assert_per_token(rows)
    assert all(r["support_bytes_per_token"] > 0 for r in rows)  # the support and every id's log q, binary


@pytest.mark.slow
def test_score_centering_on_agents_and_under_lag(tiny_agent_checkpoint, tmp_path):
    assert_per_token(train(agent_config(tiny_agent_checkpoint, tmp_path / "agents", agent="chain", **SC)))
    lagged = train(
        run_config(tiny_agent_checkpoint, tmp_path / "lag", async_rollout=True, max_policy_lag=1, num_rollout=3, **SC)
    )
    assert_per_token(lagged)
    assert max(r["policy_lag_max"] for r in lagged) == 1


@pytest.mark.parametrize(
    "settings, match",
    [
        (dict(use_score_centering=True), "--use-score-centering=True: needs --policy-loss reinforce"),
        (dict(policy_loss="reinforce", use_tis=True), "--use-tis=True: the reinforce loss is weighted by"),
        (dict(tis_cap=3.0), "tis_cap=3.0: is read by --use-tis or by --score-centering-weight tis|mis only"),
        (dict(SC, rollout_top_p=1.0, rollout_top_k=-1, ci_test=False), "--policy-loss='reinforce': weights by"),
        (dict(SC, rollout_engine="vllm", rollout_url="http://x", vllm_capture="native"), "with --vllm-capture native"),
    ],
)
def test_score_centering_settings_fail_closed(tiny_checkpoint, tmp_path, settings, match):
    with pytest.raises(ConfigError, match=match):
        run_config(tiny_checkpoint, tmp_path, **settings)


def test_a_sample_without_log_q_is_refused_before_any_forward():
    import numpy as np

    from support_replay import SupportTable
    from support_replay.errors import SampleError
    from support_replay.rollout.sample import Sample, check_sample_support_logq

    sample = Sample(2, 0, [1, 2], [3, 4], np.ones(2, np.int8), support=SupportTable.from_lists([[3, 5], [4]]))
    with pytest.raises(SampleError, match="sample 2: --use-score-centering is on but the sample carries no log q"):
        check_sample_support_logq(sample)
    sample.support_logq = np.log(np.array([0.5, 0.5], np.float32))
    with pytest.raises(SampleError, match="sample 2: 2 log q values for 3 support ids"):
        check_sample_support_logq(sample)
    sample.support_logq = np.log(np.array([0.5, 0.5, 1.0], np.float32))
    check_sample_support_logq(sample)


def test_score_centering_composes_with_routing_replay_on_a_moe(tiny_moe_checkpoint, tmp_path):
    rows = train(
        run_config(tiny_moe_checkpoint, tmp_path, score_centering_weight="tis", tis_cap=1.5, num_rollout=2,
                   use_rollout_routing_replay=True, **SC)
    )  # fmt: skip
    assert_per_token(rows)
    assert all(r["routing_agreement"] == 1.0 for r in rows)
