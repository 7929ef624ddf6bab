"""Asynchronous rollouts with a bounded policy lag: the producer, stale groups, --ci-test under a lag,
the support-drift metric and gate, masked IS, and the engine's abort-on-update mode."""

import math
import time

import pytest
import torch

from recipe_helpers import run_config
from support_replay import SamplingParams
from support_replay.core.logprobs import full_logprobs, support_logprobs
from support_replay.core.losses import masked_importance_weights, support_mass
from support_replay.engine import Engine
from support_replay.errors import AbortedError, CITestError, ConfigError
from support_replay.protocol import GenerateRequest, VersionSpan
from support_replay.train import lagged as lagged_module
from support_replay.train import rollouts as rollouts_module
from support_replay.train import train
from support_replay.train.producer import renumbered

# ---- the pieces ------------------------------------------------------------------------------


def test_support_mass_is_the_policy_mass_inside_the_support():
    torch.manual_seed(0)
    logits = torch.randn(5, 40) * 3
    targets = torch.tensor([3, 7, 1, 0, 39])
    ids = torch.tensor([[3, 4, 5, 0], [7, 8, 0, 0], [1, 2, 3, 4], [0, 0, 0, 0], [39, 38, 0, 0]])
    valid = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]], dtype=torch.bool)
    mass = support_mass(full_logprobs(logits, targets, 0.7), support_logprobs(logits, targets, (ids, valid), 0.7))
    probs = torch.softmax(logits / 0.7, -1)
    direct = torch.stack([probs[t, ids[t][valid[t]]].sum() for t in range(5)])
    torch.testing.assert_close(mass, direct, rtol=1e-5, atol=1e-6)


def test_masked_importance_weights_keep_ratios_inside_the_band():
    old = torch.zeros(5)
    mu = torch.tensor([0.0, -0.6, 0.6, -math.log(2.0) + 1e-4, 2.0])  # ratios 1, e^0.6, e^-0.6, just under 2, e^-2
    assert masked_importance_weights(old, mu, cap=2.0).tolist() == [1.0, 1.0, 1.0, 1.0, 0.0]
    assert masked_importance_weights(old, mu, cap=1.5).tolist() == [1.0, 0.0, 0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "values, message",
    [
        (
            dict(async_rollout=True),
            "--async-rollout=True: samples the next rollout on the weights before this update: needs --max-policy-lag "
            ">= 1",
        ),
        (
            dict(async_rollout=True, max_policy_lag=1, weight_sync_mode="abort", failed_group_policy="drop"),
            "--weight-sync-mode='abort'",
        ),
        (dict(tis_mode="mask"), "--tis-mode='mask': has no effect without --use-tis"),
        (dict(use_tis=True, tis_mode="mask", tis_cap=1.0), "--tis-cap=1.0: masked IS"),
        (
            dict(min_support_mass=0.5, rollout_top_p=1.0, rollout_top_k=-1, ci_test=False),
            "--min-support-mass=0.5: measures the mass",
        ),
        (
            dict(stale_sample_policy="drop", global_batch_size=2, micro_batch_size=1),
            "--stale-sample-policy='drop': drops whole groups",
        ),
    ],
)
def test_async_settings_that_cannot_work_are_refused(tiny_checkpoint, tmp_path, values, message):
    with pytest.raises(ConfigError) as err:
        run_config(tiny_checkpoint, tmp_path, **values)
    assert message in str(err.value)


def test_renumbered_keeps_groups_and_episodes_apart(tiny_checkpoint, tmp_path):
    from recipe_helpers import parts

    _, rollouts = parts(tiny_checkpoint, run_config(tiny_checkpoint, tmp_path))
    samples = rollouts.produce(0)[0]
    again, _ = rollouts.regenerate(0, [0], 1)  # prompt 0 generated again, with other seeds
    rollouts.close()
    assert [s.metadata["prompt"] for s in again] == [0] * 4
    assert [s.response_ids for s in again] != [s.response_ids for s in samples[:4]]
    merged = renumbered(sorted(samples[4:] + again, key=lambda s: s.metadata["prompt"]))
    assert [s.index for s in merged] == list(range(8)) and [s.group for s in merged] == [0] * 4 + [1] * 4
    assert merged[0].response_ids == again[0].response_ids and merged[4].response_ids == samples[4].response_ids


# ---- the engine: an update that does not wait ------------------------------------------------


def test_an_update_in_abort_mode_fails_the_running_requests_and_applies_at_once(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint).start()
    try:
        params = SamplingParams(temperature=1.0, top_k=8, seed=1)
        running = [
            engine.submit(GenerateRequest([1, 2, 3], params, max_new_tokens=400, ignore_eos=True)) for _ in range(3)
        ]
        while engine.num_running < 3:
            time.sleep(0.01)
        state = {k: v.clone() for k, v in engine.runner.model.state_dict().items()}
        assert engine.update_weights(state, "7", abort_all_requests=True).result(timeout=60) == "7"
        for f in running:  # aborted, not waited for: none of them reached its 400 tokens
            with pytest.raises(AbortedError, match="a weight update aborted it"):
                f.result(timeout=5)
        after = engine.generate([GenerateRequest([1, 2, 3], params, max_new_tokens=4)])[0]
        assert after.weight_versions == [VersionSpan("7", 0, after.num_tokens)]
        assert engine.ledger.snapshot()[0]["aborted"] == 3
    finally:
        engine.shutdown()


# ---- runs ------------------------------------------------------------------------------------


ASYNC = dict(async_rollout=True, max_policy_lag=1, num_rollout=3)


@pytest.fixture
def push_after_the_rollout(monkeypatch):
    """An abort-mode push waits until the in-process engine has answered what it runs: a push that found the rollout
    sampled beside the update still running would abort it, and its regeneration would train at lag 0, so whether a
    rollout trained one update behind was a race between the update and the generation. Held so, each rollout from
    the second on trains exactly one update behind, whatever the machine's speed. (The engine's abort of running
    requests is test_an_update_in_abort_mode_fails_the_running_requests_and_applies_at_once's.)"""
    queue = Engine._queue_update

    def after_the_rollout(engine, source, version, abort_all_requests, adapter=False):
        while abort_all_requests and (engine.num_running or engine.num_waiting):
            time.sleep(0.002)  # the generation ends by itself: this waits for it, not for a time
        return queue(engine, source, version, abort_all_requests, adapter)

    monkeypatch.setattr(Engine, "_queue_update", after_the_rollout)


@pytest.mark.parametrize("mode", ["wait", "abort"])
def test_async_grpo_passes_ci_test_per_token_under_the_weights_that_sampled_it(
    tiny_checkpoint, tmp_path, mode, request
):
    if mode == "abort":
        request.getfixturevalue("push_after_the_rollout")
    rows = train(run_config(tiny_checkpoint, tmp_path, weight_sync_mode=mode, **ASYNC))
    assert [r["policy_lag_max"] for r in rows] == [0, 1, 1]
    for r in rows:
        assert r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and r["stale_samples"] == 0
        assert 0 < r["support_mass_min"] <= r["support_mass_mean"] <= 1
    assert (
        "support_mass_stale_mean" not in rows[0] and rows[1]["support_mass_stale_mean"] == rows[1]["support_mass_mean"]
    )
    assert all(r["time_generation"] > 0 for r in rows)


def test_without_the_kept_weights_the_lagged_tokens_fail_ci_test(tiny_checkpoint, tmp_path, monkeypatch):
    # the check can fail: scored under the current weights only, the tokens of rollout 1 are one update off
    monkeypatch.setattr(
        lagged_module.LaggedScorer, "by_sampling_version", lambda self, samples, logp, current, semantics: logp
    )
    with pytest.raises(CITestError, match="--ci-test failed at rollout 1"):
        train(run_config(tiny_checkpoint, tmp_path, **ASYNC))


def stale_group_zero(monkeypatch, at_rollout: int, version: str = "0"):
    """Make the engine answer prompt 0 of one rollout as sampled by ``version`` (stale weights)."""
    original = rollouts_module.Rollouts.produce

    def produce(self, r, pushed=None):
        samples, stats = original(self, r, pushed)
        if r == at_rollout:
            for s in samples:
                if s.metadata["prompt"] == 0:
                    s.weight_versions = [VersionSpan(version, 0, s.response_length)]
        return samples, stats

    monkeypatch.setattr(rollouts_module.Rollouts, "produce", produce)


def test_a_group_beyond_the_lag_is_dropped_not_trained(tiny_checkpoint, tmp_path, monkeypatch):
    stale_group_zero(monkeypatch, 2)  # at rollout 2 the trainer pushed '2': version '0' is 2 pushes old
    rows = train(run_config(tiny_checkpoint, tmp_path, stale_sample_policy="drop", **ASYNC))
    assert rows[2]["stale_samples"] == 4 and rows[2]["stale_groups_dropped"] == 1 and rows[2]["policy_lag_max"] <= 1
    assert rows[2]["train_rollout_logprob_abs_diff_max"] <= 1e-3  # what trained passed --ci-test
    assert [r["stale_groups_dropped"] for r in rows] == [0, 0, 1] and [r["samples"] for r in rows] == [8, 8, 4]


def test_a_group_beyond_the_lag_is_generated_again_on_the_current_weights(tiny_checkpoint, tmp_path, monkeypatch):
    stale_group_zero(monkeypatch, 2)
    rows = train(run_config(tiny_checkpoint, tmp_path, stale_sample_policy="regenerate", **ASYNC))
    assert (
        rows[2]["stale_groups_regenerated"] == 1 and rows[2]["policy_lag_max"] == 1
    )  # the other group was generated during the update
    assert rows[2]["train_rollout_logprob_abs_diff_max"] <= 1e-3


def test_the_drift_gate_takes_stale_samples_out_of_the_loss(tiny_checkpoint, tmp_path):
    rows = train(
        run_config(tiny_checkpoint, tmp_path, min_support_mass=1.0, **ASYNC)
    )  # every stale sample has mass < 1
    assert [r["drift_gated_samples"] for r in rows] == [0, 8, 8]
    assert rows[1]["loss"] == 0.0 and rows[0]["loss"] != 0.0  # nothing of the gated rollout trains


def test_a_crash_with_a_rollout_in_flight_resumes_losing_nothing_trained(tiny_checkpoint, tmp_path, monkeypatch):
    from support_replay.errors import NonFiniteError
    from support_replay.train import learner as learner_module

    save = dict(save=str(tmp_path / "ckpt"), save_interval=1, async_rollout=True, max_policy_lag=1)
    original = learner_module.Learner.optimizer_step

    def crash_at_rollout_2(self, rollout):
        if rollout == 2:  # rollout 3 is being generated meanwhile
            raise NonFiniteError("a crash in the middle of rollout 2's update")
        return original(self, rollout)

    monkeypatch.setattr(learner_module.Learner, "optimizer_step", crash_at_rollout_2)
    with pytest.raises(NonFiniteError):
        train(run_config(tiny_checkpoint, tmp_path, num_rollout=4, **save))
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == [
        "rollout_000001",
        "rollout_000002",
    ]  # updates 0 and 1 kept
    monkeypatch.setattr(learner_module.Learner, "optimizer_step", original)
    resumed = train(run_config(tiny_checkpoint, tmp_path, num_rollout=4, resume=True, **save))
    # rollout 2 (its update lost) and 3 (in flight) are generated again: 2 on the saved weights '2', 3 one push behind
    assert [r["rollout"] for r in resumed][-2:] == [2, 3]
    assert [r["policy_lag_max"] for r in resumed][-2:] == [0, 1]
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in resumed[-2:])


@pytest.mark.slow
@pytest.mark.processes
def test_async_grpo_through_serve_over_http(tiny_checkpoint, tmp_path, monkeypatch):
    """Both directions over HTTP only: rollouts from serve, weights in the request body (no shared
    filesystem), each push aborting what runs."""
    import httpx

    from processes import engine_process

    monkeypatch.setenv("SUPPORT_REPLAY_ADMIN_KEY", "admin-secret")  # serve and the trainer's sync read it
    ctx, url = engine_process(tiny_checkpoint)
    with ctx:
        rows = train(
            run_config(
                tiny_checkpoint,
                tmp_path,
                rollout_url=url,
                weight_sync_mode="abort",
                weight_transport="http",
                rollout_max_response_len=16,
                **ASYNC,
            )
        )
        assert httpx.get(url + "/model_info").json()["weight_version"] == "3"
    assert not (tmp_path / "out" / "weights").exists()  # nothing staged on disk
    # a rollout that finishes before the next push trains one push behind; one still running when
    # the push lands is aborted and generated again on the new weights: both are right, the
    # engine's speed against the update's decides which (seen both ways here)
    lags = [r["policy_lag_max"] for r in rows]
    assert lags[0] == 0 and set(lags[1:]) <= {0, 1}, lags
    for r in rows:  # per token against the log mu the engine sent, under the weights that sampled it
        assert r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and r["support_bytes_per_token"] > 0
