"""Partial rollouts (rollout/partial.py): over-sampled groups, the first to finish trained, the others stopped with
their tokens kept and continued after the next push, every token replayed under the weights that sampled it."""

import copy
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from processes import engine_process
from push_gate import PushGate
from push_gate import environment as push_gate_environment
from recipe_helpers import agent_config, run_config
from sampled_supports import replayed_diff
from stop_gate import StopGate
from stop_gate import environment as stop_gate_environment
from support_replay import SamplingParams
from support_replay.backends.local import EngineBackend
from support_replay.engine import Engine, EngineSettings
from support_replay.engine.limits import EngineLimits
from support_replay.errors import CITestError, ConfigError, EngineUnavailable
from support_replay.protocol import Completion
from support_replay.rollout.data import Prompt
from support_replay.rollout.generate import Asked
from support_replay.rollout.partial import PartialRollouts
from support_replay.train import train

N, TOKENS = 2, 12


def digit_share(prompt: str, text: str, label) -> float:
    return sum(c.isdigit() for c in text) / max(1, len(text))


def replayed(model, sample, start: int, end: int) -> float:
    return replayed_diff(model, sample.prompt_ids, sample.response_ids, sample.support, sample.log_mu, start, end)


PROMPTS = [Prompt(f"Count {i}: 1 2 3", None) for i in range(100)]
KW = dict(reward_fn=digit_share, seed=3, rid_prefix="test")


def two_groups_at_a_time(checkpoint) -> Engine:
    """Our engine decoding 2 * N rows at a time: of the four groups a buffer sends, two wait, so the stop finds some
    running."""
    limits = EngineLimits(max_batch_size=2 * N)
    return Engine.from_pretrained(checkpoint, EngineSettings(seed=0, limits=limits, weight_version="0"))


def asked_for(**params) -> Asked:
    params = SamplingParams(temperature=1.0, top_k=8, **params)
    return Asked(params, n_samples=N, max_new_tokens=TOKENS, capture=True, ignore_eos=True)


def push(engine: Engine, state: dict, version: str) -> None:
    engine.wait([update := engine.update_weights(state, version)])
    update.result()


def test_stopped_samples_are_kept_and_continued_under_the_next_weights(tiny_checkpoint):
    """Four groups sent, two decoded at a time: the first two to finish train, the others are stopped with the
    tokens they have and continued after a push, first in line; nothing is generated twice, and each token is
    replayed under the version that sampled it."""
    engine = two_groups_at_a_time(tiny_checkpoint)
    backend = EngineBackend(engine)
    asked = asked_for(top_p=0.9)
    partial = PartialRollouts(target=2, over_sampling=4)

    first, stats0 = partial.generate(backend, engine.tokenizer, PROMPTS, asked, rollout=0, **KW)
    assert [s.metadata["prompt"] for s in first] == [0, 0, 1, 1]
    assert stats0.stopped_requests > 0 and stats0.kept_groups == 2 and 0 < stats0.kept_tokens < 2 * N * TOKENS
    assert stats0.generated_tokens == stats0.trained_tokens + stats0.kept_tokens  # none thrown away

    old = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    new = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    state = {k: v + 0.05 * v.abs().mean() * torch.randn(v.shape, generator=gen) for k, v in new.state_dict().items()}
    new.load_state_dict(state)
    push(engine, state, "1")

    second, stats1 = partial.generate(backend, engine.tokenizer, PROMPTS, asked, rollout=1, **KW)
    assert [s.metadata["prompt"] for s in second] == [2, 2, 3, 3]  # the kept groups, continued first
    assert stats1.continued_samples > 0
    assert stats0.generated_tokens + stats1.generated_tokens == (
        stats0.trained_tokens + stats1.trained_tokens + stats1.kept_tokens
    )
    straddling = [s for s in second if len(s.weight_versions) == 2]
    assert straddling, [s.weight_versions for s in second]
    for s in second:
        assert len(s.response_ids) == TOKENS and s.status == "truncated"
        spans = {span.version: span for span in s.weight_versions}
        if "0" in spans:
            assert replayed(old, s, spans["0"].start, spans["0"].end) < 1e-4
            assert s.output_starts == [0, spans["0"].end]  # the continued request's own output began there
        assert replayed(new, s, spans["1"].start, spans["1"].end) < 1e-4


PARTIAL = dict(
    partial_rollout=True, over_sampling_batch_size=4, max_policy_lag=1, num_rollout=3, rollout_max_response_len=12,
    rollout_ignore_eos=True,
)  # fmt: skip
SAMPLES = 4  # run_config's groups


@pytest.fixture
def stop_gate():
    """The partial rollouts' stop gate on this process's engines (tests/stop_gate.py): each rollout's last group
    waits in the engine's queue until the rollout's stop, which so always finds requests unfinished, whatever the
    machine's speed."""
    gate = StopGate(SAMPLES).install()
    yield gate
    gate.uninstall()


def test_a_kept_group_too_old_to_train_is_dropped_before_it_is_continued_and_the_rollout_still_fills(
    tiny_checkpoint,
):
    """Under --max-policy-lag 1, a kept group whose finished sample holds only tokens two pushes old could train
    nothing of it: it is dropped when taken from the buffer (counted, with every token it held), none of its samples
    is continued, and the over-sampled groups fill the rollout (dropped after generation instead, it would leave the
    global batch short, and the trainer would skip the whole rollout)."""
    engine = two_groups_at_a_time(tiny_checkpoint)
    backend, asked = EngineBackend(engine), asked_for()
    partial = PartialRollouts(target=2, over_sampling=4, max_lag=1)
    _, first = partial.generate(backend, engine.tokenizer, PROMPTS, asked, rollout=0, ages={"0": 0}, **KW)
    stale, fresh = list(partial.kept)
    j = max(range(N), key=lambda j: stale.samples[j].response_length)
    assert stale.samples[j].response_length > 0 and not stale.finished[j]
    stale.finished[j] = True  # as if it had ended by itself at the stop: every token it has is version "0"
    held = stale.kept_tokens

    state = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).state_dict()
    for version in ("1", "2"):  # two pushes: version "0" is now two old
        push(engine, state, version)
    samples, stats = partial.generate(
        backend, engine.tokenizer, PROMPTS, asked, rollout=1, ages={"0": 2, "1": 1, "2": 0}, **KW
    )
    assert (stats.lag_dropped_kept_groups, stats.lag_dropped_kept_tokens) == (1, held)
    trained = {s.metadata["prompt"] for s in samples}
    assert len(trained) == 2 and stale.number not in trained and fresh.number in trained
    assert all(g is not stale for g in partial.kept)
    # every token generated trained, is kept, or was dropped with its group (counted)
    assert first.generated_tokens + stats.generated_tokens == (
        first.trained_tokens + stats.trained_tokens + stats.kept_tokens + stats.lag_dropped_kept_tokens
    )


class ReportedLast:
    """Our engine's backend, every request run to its end, then reported done with ``last``'s requests last; the
    stops asked for are recorded (the requests had ended: each stop is a no-op)."""

    def __init__(self, inner, last):
        self.inner, self.last, self.stopped = inner, last, []

    def generate(self, requests, *, on_done, **kw):
        calls = []
        answers = self.inner.generate(requests, on_done=lambda i, finished: calls.append((i, finished)), **kw)
        for i, finished in sorted(calls, key=lambda call: self.last(requests[call[0]])):
            on_done(i, finished)
        return answers

    def stop(self, requests):
        self.stopped += list(requests)


def test_a_kept_group_at_the_lag_is_not_stopped_again_so_none_of_its_tokens_ages_out(tiny_checkpoint):
    """Under --max-policy-lag 1 a group kept from the last rollout holds tokens one push old: stopped again, they
    would be two old when it trains (masked, or the group dropped). So the rollout does not stop it: the stop waits
    until it has finished, though ``target`` other groups finished before it, and it trains in this rollout."""
    engine, asked = two_groups_at_a_time(tiny_checkpoint), asked_for()
    partial = PartialRollouts(target=2, over_sampling=4, max_lag=1)
    partial.generate(EngineBackend(engine), engine.tokenizer, PROMPTS, asked, rollout=0, ages={"0": 0}, **KW)
    at_lag = next(g for g in partial.kept if g.kept_tokens and not g.done)
    state = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).state_dict()
    push(engine, state, "1")

    def its_own(req) -> bool:
        return req.input_ids[: len(at_lag.ids)] == at_lag.ids

    without_lag = copy.deepcopy(partial)  # the same buffer, no lag to honour: it stops the group again
    without_lag.max_lag = None
    control = ReportedLast(EngineBackend(engine), its_own)
    without_lag.generate(control, engine.tokenizer, PROMPTS, asked, rollout=1, ages={"0": 1, "1": 0}, **KW)
    assert any(its_own(req) for req in control.stopped)

    backend = ReportedLast(EngineBackend(engine), its_own)
    samples, stats = partial.generate(backend, engine.tokenizer, PROMPTS, asked, rollout=1, ages={"0": 1, "1": 0}, **KW)
    assert not any(its_own(req) for req in backend.stopped) and stats.lag_dropped_kept_groups == 0
    trained = [s for s in samples if s.metadata["prompt"] == at_lag.number]
    assert len(trained) == N and {span.version for s in trained for span in s.weight_versions} == {"0", "1"}


class StopRefused:
    """Our engine's backend whose stop fails, as ``/abort_request`` does through a router without the route or to a
    dead engine behind a broadcast."""

    def __init__(self, inner):
        self.inner, self.asked = inner, 0

    def generate(self, requests, **kw):
        return self.inner.generate(requests, **kw)

    def stop(self, requests):
        self.asked += 1
        raise EngineUnavailable("stopping at http://engine:1: /abort_request failed for 4 of 4 requests")


def test_a_stop_the_engine_refuses_keeps_the_answer_that_asked_for_it_and_the_rest_run_to_their_end(tiny_checkpoint):
    """The stop is asked from the callback of the answer that completed the target: a stop that raised there failed
    that answer (counted as a failed sample) and left the other requests unstopped behind an error. Now the answer
    keeps, the failed stop is counted, and the requests it did not stop run to their end: nothing is lost."""
    engine = two_groups_at_a_time(tiny_checkpoint)
    backend = StopRefused(EngineBackend(engine))
    partial = PartialRollouts(target=2, over_sampling=4)
    samples, stats = partial.generate(backend, engine.tokenizer, PROMPTS, asked_for(), rollout=0, **KW)
    assert backend.asked == 1 and stats.failed_stops == 1 and stats.failed_samples == 0
    assert [s.metadata["prompt"] for s in samples] == [0, 0, 1, 1]
    assert all(len(s.response_ids) == TOKENS for s in samples)
    assert stats.generated_tokens == stats.trained_tokens + stats.kept_tokens == 4 * N * TOKENS  # all ran to the end


class StoppedInTheQueue:
    """Our engine's backend whose answers to the last two requests of the first call are SGLang's to a request stopped
    in its waiting queue (never prefilled: no output, no capture, finish reason ``abort``)."""

    def __init__(self, inner):
        self.inner, self.calls, self.sent = inner, 0, []

    def generate(self, requests, **kw):
        self.calls += 1
        self.sent.append([r.rid for r in requests])
        answers = self.inner.generate(requests, **kw)
        if self.calls == 1:
            for i in (-2, -1):
                answers[i] = Completion([], {"type": "abort", "message": "Abort in waiting queue"})
        return answers

    def stop(self, requests):
        return self.inner.stop(requests)


def test_a_request_stopped_before_its_first_token_is_sent_again_as_it_was(tiny_checkpoint):
    """An empty aborted answer (SGLang 0.5.23's to a stop that finds the request in its waiting queue) holds no
    segment: the sample is not finished, nothing is appended, and the next rollout sends the same prompt again from
    its start; the samples still come out whole."""
    engine = two_groups_at_a_time(tiny_checkpoint)
    backend = StoppedInTheQueue(EngineBackend(engine))
    partial = PartialRollouts(target=2, over_sampling=4)
    first, stats0 = partial.generate(backend, engine.tokenizer, PROMPTS, asked_for(), rollout=0, **KW)
    emptied = backend.sent[0][-2:]
    second, _ = partial.generate(backend, engine.tokenizer, PROMPTS, asked_for(), rollout=1, **KW)
    resent = [rid for rid in backend.sent[-1] if rid.rsplit("/", 3)[-2:] in [e.rsplit("/", 3)[-2:] for e in emptied]]
    assert len(resent) == 2 and all(rid.endswith("/0") for rid in resent), (emptied, backend.sent[-1])
    for s in first + second:
        assert len(s.response_ids) == TOKENS and len(s.log_mu) == TOKENS
        assert s.metadata["partial_segments"] == len(s.output_starts)
    assert stats0.failed_samples == 0


@pytest.mark.parametrize("where", ["in-process", pytest.param("serve", marks=pytest.mark.processes)])
def test_grpo_ci_test_holds_for_samples_that_straddle_a_push(tiny_checkpoint, tmp_path, where, request):
    """Samples kept across a push are trained with tokens of two versions, each compared under its own weights
    (within 1e-3); no token generated is thrown away. The stop gate holds each rollout's last group until the stop,
    in serve's process too."""
    if where == "serve":
        server, url = engine_process(tiny_checkpoint, "--max-running-requests", "4", env=stop_gate_environment(SAMPLES))
        with server:
            rows = train(run_config(tiny_checkpoint, tmp_path, rollout_url=url, **PARTIAL))
    else:
        request.getfixturevalue("stop_gate")
        rows = train(run_config(tiny_checkpoint, tmp_path, max_running_requests=4, **PARTIAL))
    check_partial_rows(rows)
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)


@pytest.mark.float_bits  # true-on-policy mode: every token at tolerance 0
def test_in_true_on_policy_mode_straddling_samples_replay_to_the_bit(tiny_checkpoint, tmp_path, stop_gate):
    """The kept tokens under the weights that sampled them, the continued ones after a recompute through the
    invariant prefill: every token of every sample equal to the bit."""
    rows = train(run_config(tiny_checkpoint, tmp_path, max_running_requests=4, true_on_policy_mode=True, **PARTIAL))
    check_partial_rows(rows)
    assert all(r["train_rollout_unequal_tokens"] == 0 for r in rows)


def check_partial_rows(rows: list[dict]) -> None:
    """Every rollout stopped some requests, later ones trained straddling samples at lag 1, nothing thrown away."""
    assert all(r["stopped_requests"] > 0 for r in rows)
    assert sum(r["straddling_samples"] for r in rows[1:]) > 0  # kept tokens of one version, the rest of the next
    assert max(r["policy_lag_max"] for r in rows) == 1
    generated = sum(r["generated_tokens"] for r in rows)
    assert generated == sum(r["trained_tokens"] for r in rows) + rows[-1]["kept_tokens"]  # 0 thrown away


def test_kept_groups_hold_the_trainers_capture_budget_and_over_sampling_waits_for_them(tiny_checkpoint, tmp_path):
    """--max-kept-capture-ids: once the kept groups hold more support ids than it allows, a rollout sends no fresh
    groups beyond the ones it trains; the kept ones still go on and nothing is thrown away. The stop gate holds the
    first rollout's last group, so that it keeps some (the next sends only the groups it trains: nothing to hold)."""
    gate = StopGate(SAMPLES, rollouts={0}).install()
    try:
        rows = train(run_config(tiny_checkpoint, tmp_path, max_running_requests=4, max_kept_capture_ids=1, **PARTIAL))
    finally:
        gate.uninstall()
    assert rows[0]["kept_capture_ids"] > 1  # the first rollout kept more than the budget
    for before, r in zip(rows, rows[1:]):  # a rollout over-samples again once the kept ones have drained
        assert (r["over_sampling_held"] > 0) == (before["kept_capture_ids"] > 1)
    assert rows[1]["over_sampling_held"] == 2 and rows[1]["stopped_requests"] == 0  # 4 groups asked, 2 sent
    generated = sum(r["generated_tokens"] for r in rows)
    assert generated == sum(r["trained_tokens"] for r in rows) + rows[-1]["kept_tokens"]  # 0 thrown away
    with pytest.raises(ConfigError, match="--max-kept-capture-ids=5: is read with --partial-rollout only"):
        run_config(tiny_checkpoint, tmp_path, max_kept_capture_ids=5)


def test_partial_rollouts_refuse_what_they_cannot_keep(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="partial-rollout=True: trains kept tokens.*max-policy-lag >= 1"):
        run_config(tiny_checkpoint, tmp_path, partial_rollout=True)
    with pytest.raises(ConfigError, match="partial-rollout.*async"):
        run_config(tiny_checkpoint, tmp_path, partial_rollout=True, max_policy_lag=1, async_rollout=True)
    with pytest.raises(ConfigError, match="over-sampling-batch-size=1: sends fewer groups"):
        run_config(tiny_checkpoint, tmp_path, partial_rollout=True, max_policy_lag=1, over_sampling_batch_size=1)
    with pytest.raises(ConfigError, match="partial-rollout.*resume"):
        run_config(tiny_checkpoint, tmp_path, partial_rollout=True, max_policy_lag=1, resume=True, save=str(tmp_path))


@pytest.mark.float_bits  # the masked tokens' exact exclusion from --ci-test at tolerance 0
def test_tokens_older_than_the_lag_are_masked_not_trained_and_not_compared():
    """A kept sample continued twice holds tokens two pushes old under --max-policy-lag 1: they stay its context, are
    masked (counted), its lag is that of its live tokens, and --ci-test skips them; a group whose sample has no live
    token left is dropped."""
    import numpy as np

    from support_replay.protocol import VersionSpan
    from support_replay.rollout.sample import Sample
    from support_replay.train.checks import check_policy_lag, compare_with_rollout, mask_beyond_lag, version_ages

    def sample(index: int, prompt: int, spans: list[tuple[str, int, int]]) -> Sample:
        n = spans[-1][2]
        return Sample(
            index,
            prompt,
            [1, 2],
            list(range(3, 3 + n)),
            np.ones(n, np.int8),
            log_mu=np.full(n, -0.5, np.float32),
            weight_versions=[VersionSpan(*span) for span in spans],
            metadata={"prompt": prompt},
        )

    ages = version_ages(["0", "1", "2"])
    straddling = sample(0, 0, [("0", 0, 2), ("1", 2, 5), ("2", 5, 8)])
    all_old = sample(1, 1, [("0", 0, 4)])
    left, counts = mask_beyond_lag([straddling, sample(2, 0, [("2", 0, 3)]), all_old], ages, max_lag=1)
    assert counts == {"lag_masked_tokens": 6, "lag_dropped_samples": 1, "lag_dropped_groups": 1}
    assert [s.index for s in left] == [0, 2] and straddling.loss_mask.tolist() == [0, 0, 1, 1, 1, 1, 1, 1]
    assert check_policy_lag(0, left, ["0", "1", "2"], 1, "engine")[0]["policy_lag_max"] == 1
    logp = [torch.full((8,), -0.5), torch.full((3,), -0.5)]
    logp[0][:2] = 3.0  # masked tokens scored under other weights: not compared
    stats = compare_with_rollout(0, left, logp, tolerance=0.0, fail=True)
    assert stats["train_rollout_compared_tokens"] == 9 and stats["train_rollout_logprob_abs_diff_max"] == 0.0


@pytest.fixture
def push_gate():
    """The in-flight updates' push gate on this process's engines (tests/push_gate.py): a rollout's requests (from
    rollout 1 on) sample their first token and wait until the engine takes the next weights, so that the push always
    lands among running requests (--async-rollout), whatever the machine's speed."""
    gate = PushGate().install()
    yield gate
    gate.uninstall()


IN_FLIGHT = dict(
    async_rollout=True, max_policy_lag=1, weight_sync_mode="retract", num_rollout=3, rollout_max_response_len=60,
    rollout_ignore_eos=True,
)  # fmt: skip


@pytest.mark.float_bits  # true-on-policy mode: every token at tolerance 0
@pytest.mark.parametrize("mode", ["normal", "true-on-policy"])
def test_a_push_lands_among_running_requests_and_each_token_replays_under_its_version(
    tiny_checkpoint, tmp_path, push_gate, mode
):
    """--weight-sync-mode retract under --async-rollout: the push pauses the engine between decode steps, the
    running requests are recomputed under the new weights and go on; their samples hold tokens of two versions,
    each compared under its own weights (to the bit in true-on-policy mode, the recompute through the invariant
    prefill), and no request is aborted."""
    extra = dict(true_on_policy_mode=True) if mode == "true-on-policy" else {}
    rows = train(run_config(tiny_checkpoint, tmp_path, **IN_FLIGHT, **extra))
    assert sum(r["straddling_samples"] for r in rows) > 0
    assert all(r["failed_samples"] == 0 and r["regenerated_groups"] == 0 for r in rows)
    if mode == "true-on-policy":
        assert all(r["train_rollout_unequal_tokens"] == 0 for r in rows)
    else:
        assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)
    for r in rows:  # the distribution of token lags, and the support drift per lag where the full head ran
        shares = {k: v for k, v in r.items() if k.startswith("token_lag_")}
        assert shares and sum(shares.values()) == pytest.approx(1.0)
    straddled = [r for r in rows if r["straddling_samples"]]
    assert all(0 < r["token_lag_0_share"] < 1 and r["token_lag_1_share"] > 0 for r in straddled)
    assert any("support_mass_lag1_mean" in r and "support_mass_lag0_mean" in r for r in straddled)


def test_an_agent_episode_straddling_an_in_flight_push_replays_each_token_under_its_version(
    tiny_agent_checkpoint, tmp_path, push_gate
):
    """Agents under --weight-sync-mode retract: a turn that runs while the push lands holds tokens of two
    versions (the episode's later turns are sampled under the new weights), and --ci-test holds on every one."""
    extra = {k: v for k, v in IN_FLIGHT.items() if k != "rollout_ignore_eos"}
    rows = train(agent_config(tiny_agent_checkpoint, tmp_path, **extra))
    assert sum(r["straddling_samples"] for r in rows) > 0
    assert all(r["failed_samples"] == 0 for r in rows)
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)


def test_ci_test_names_the_stale_keys_and_values_of_an_in_place_push(tiny_checkpoint, tmp_path):
    """--weight-sync-mode in_place keeps the old weights' keys and values of a running request's prefix: its later
    tokens are not the trained policy's, and --ci-test says so, naming the push the token came after. The push gate
    holds rollout 1 only: the run fails on it, and rollout 2 (generating meanwhile) must end without a push."""
    extra = {**IN_FLIGHT, "weight_sync_mode": "in_place", "lr": 1e-2}
    gate = PushGate(rollouts={1}).install()
    try:
        with pytest.raises(CITestError, match="under --weight-sync-mode in_place.*retract recomputes them"):
            train(run_config(tiny_checkpoint, tmp_path, **extra))
    finally:
        gate.uninstall()
    assert gate.held_steps > 0


R3 = dict(use_rollout_routing_replay=True)
MOE_IN_FLIGHT = {**IN_FLIGHT, **R3, "num_rollout": 2}  # the push of the first update lands in the second rollout


@pytest.mark.parametrize(
    "mode",
    [
        "normal",
        pytest.param("true-on-policy", marks=pytest.mark.float_bits),
        pytest.param("serve", marks=pytest.mark.processes),
    ],
)  # true-on-policy mode: every token at tolerance 0, under each kernel set
def test_a_moe_replays_each_token_under_the_routing_that_sampled_it_across_an_in_flight_push(
    tiny_moe_checkpoint, tmp_path, push_gate, mode
):
    """Routing replay under --weight-sync-mode retract: a running request's prefix is routed again by the recompute
    under the new weights; its tokens before the push are scored under the routing that sampled them (a row of
    their own), the later ones under the recompute's, each under its version's weights: --ci-test holds, to the bit
    in true-on-policy mode. Through ``serve`` the earlier routing comes in ``meta_info["routed_experts_history"]``
    (the push gate in serve's process)."""
    if mode == "serve":
        server, url = engine_process(tiny_moe_checkpoint, env=push_gate_environment())
        with server:
            rows = train(run_config(tiny_moe_checkpoint, tmp_path, rollout_url=url, **MOE_IN_FLIGHT))
    else:
        extra = dict(true_on_policy_mode=True) if mode == "true-on-policy" else {}
        rows = train(run_config(tiny_moe_checkpoint, tmp_path, **MOE_IN_FLIGHT, **extra))
    straddled = [r for r in rows if r["straddling_samples"]]
    assert straddled and all(r["routing_history_rows"] > 0 for r in straddled)
    if mode == "true-on-policy":
        assert all(r["train_rollout_unequal_tokens"] == 0 for r in rows)
    else:
        assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)


def test_a_moe_s_kept_samples_replay_the_routing_of_each_request_that_sampled_them(
    tiny_moe_checkpoint, tmp_path, stop_gate
):
    """Partial rollouts with routing replay: a continued sample's kept tokens are scored under the stopped
    request's routing, its new ones under the continuation's (which routed the kept prefix again)."""
    rows = train(run_config(tiny_moe_checkpoint, tmp_path, max_running_requests=4, **PARTIAL, **R3))
    check_partial_rows(rows)
    assert sum(r["routing_history_rows"] for r in rows[1:]) > 0
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)


def test_an_in_place_push_is_refused_with_routing_replay(tiny_moe_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="weight-sync-mode='in_place': keeps the old weights' keys.*routing"):
        run_config(tiny_moe_checkpoint, tmp_path, **{**IN_FLIGHT, "weight_sync_mode": "in_place"}, **R3)


def test_without_the_earlier_routing_a_moe_s_straddling_tokens_fail_ci_test(
    tiny_moe_checkpoint, tmp_path, push_gate, monkeypatch
):
    """The same run with the earlier computations' rows left out (every token under the recompute's routing): the
    tokens sampled before the push no longer replay, and --ci-test names them."""
    from support_replay.train import batches

    monkeypatch.setattr(batches, "_segments", lambda s: [])
    with pytest.raises(CITestError, match=r"\|diff\| (\S+) > tolerance") as failed:
        train(run_config(tiny_moe_checkpoint, tmp_path, **{**MOE_IN_FLIGHT, "lr": 1e-2}))
    assert float(re.search(r"\|diff\| (\S+) >", str(failed.value)).group(1)) > 0.1


PENALTIES = dict(rollout_repetition_penalty=1.3, rollout_frequency_penalty=0.2, rollout_presence_penalty=-0.3)


@pytest.mark.parametrize("how", ["partial", "in-flight"])
def test_penalties_replay_across_a_switch(tiny_checkpoint, tmp_path, request, how):
    """Penalties over each engine request's own output history: a continued partial sample's second request
    restarts it at its first output (``output_starts``), a retracted request keeps its whole output; the trainer
    replays each so, and --ci-test holds on samples that straddle a push."""
    if how == "partial":
        request.getfixturevalue("stop_gate")
        settings = dict(PARTIAL, max_running_requests=4, num_rollout=2)
    else:
        request.getfixturevalue("push_gate")
        settings = dict(IN_FLIGHT, num_rollout=2)
    rows = train(run_config(tiny_checkpoint, tmp_path, **settings, **PENALTIES))
    assert sum(r["straddling_samples"] for r in rows) > 0
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)
