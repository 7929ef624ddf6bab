"""GRPO with penalties and a logit bias on: --ci-test per token through the in-process engine
(each engine's semantics), through `serve`, on multi-turn agent episodes, and bitwise in
true-on-policy mode; replay that ignores the penalty fails the check; engines whose penalty
rules are not pinned are refused."""

import json
from types import SimpleNamespace

import pytest

from recipe_helpers import agent_config, run_config
from support_replay.backends.sglang_kind import SGLangKind
from support_replay.backends.vllm_kind import VLLMKind
from support_replay.core.penalties import Penalties
from support_replay.errors import CITestError, ConfigError
from support_replay.serving.security import API_KEY_ENV
from support_replay.train import batches as batches_module
from support_replay.train import train


@pytest.fixture
def bias_file(tmp_path):
    path = tmp_path / "bias.json"
    path.write_text(json.dumps({"5": -2.0, "17": 1.5, "40": 3.0}))
    return str(path)


SETTINGS = {
    "repetition": dict(rollout_repetition_penalty=1.3),
    "frequency+presence": dict(rollout_frequency_penalty=0.5, rollout_presence_penalty=0.3),
    "all": dict(rollout_repetition_penalty=0.8, rollout_frequency_penalty=0.2, rollout_presence_penalty=-0.3),
}


# transformers has no frequency or presence penalty: hf runs the others (refusal tested in test_config)
CASES = [
    (s, n)
    for s in ("sglang", "vllm", "hf")
    for n in [*SETTINGS, "logit_bias"]
    if s != "hf" or n in ("repetition", "logit_bias")
]


@pytest.mark.parametrize("semantics, name", CASES)
def test_ci_test_passes_with_penalties_in_process(tiny_checkpoint, tmp_path, bias_file, semantics, name):
    settings = (
        dict(rollout_logit_bias=bias_file, rollout_repetition_penalty=1.2) if name == "logit_bias" else SETTINGS[name]
    )
    rows = train(
        run_config(
            tiny_checkpoint,
            tmp_path,
            num_rollout=2,
            rollout_max_response_len=24,
            sampling_semantics=semantics,
            **settings,
        )
    )
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)


@pytest.mark.float_bits
def test_true_on_policy_is_bitwise_with_penalties_and_bias(tiny_checkpoint, tmp_path, bias_file):
    rows = train(
        run_config(
            tiny_checkpoint,
            tmp_path,
            rollout_max_response_len=24,
            true_on_policy_mode=True,
            rollout_repetition_penalty=1.3,
            rollout_frequency_penalty=0.4,
            rollout_presence_penalty=0.2,
            rollout_logit_bias=bias_file,
        )
    )
    assert all(r["train_rollout_logprob_abs_diff_max"] == 0.0 and r["train_rollout_unequal_tokens"] == 0 for r in rows)


def test_replay_that_ignores_the_penalty_fails_the_check(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(batches_module.PenaltyRows, "__call__", lambda self, z, ids: z)
    with pytest.raises(CITestError):
        train(
            run_config(
                tiny_checkpoint,
                tmp_path,
                rollout_max_response_len=24,
                rollout_repetition_penalty=2.0,
                rollout_frequency_penalty=1.0,
            )
        )


def test_agent_turns_each_restart_the_output_history(tiny_agent_checkpoint, tmp_path, scored):
    rows = train(
        agent_config(
            tiny_agent_checkpoint,
            tmp_path,
            agent="chain",
            rollout_repetition_penalty=1.3,
            rollout_frequency_penalty=0.5,
        )
    )
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows) and rows[0]["episode_turns_mean"] > 1
    sample = scored[0][0][0]
    assert len(sample.output_starts) == sample.metadata["turns"] > 1 and sample.penalties.repetition == pytest.approx(
        1.3
    )


def test_engines_with_unpinned_penalty_rules_are_refused(monkeypatch):
    answers = {
        "/server_info": {"version": "0.5.23", "disable_overlap_schedule": False},
        "/version": {"version": "0.33.0"},
    }

    class Reply:
        status_code = 200

        def __init__(self, url):
            self.url = url

        def json(self):
            return next(v for k, v in answers.items() if self.url.endswith(k))

    sent = []
    monkeypatch.setattr("httpx.get", lambda url, timeout=None, headers=None: sent.append(headers) or Reply(url))
    p, at = Penalties(repetition=1.1), SimpleNamespace(rollout_url="http://x")
    with pytest.raises(
        ConfigError,
        match=r"SGLang 0.5.23 at http://x \(disable_overlap_schedule=False\): penalties \(repetition_penalty=1.1\) "
        r"are replayed",
    ):
        SGLangKind(at).penalty_semantics(p, "hf")
    answers["/server_info"]["disable_overlap_schedule"] = True
    assert SGLangKind(at).penalty_semantics(p, "hf") == "sglang"
    for both in (Penalties(repetition=1.1, presence=0.2), Penalties(repetition=1.1, frequency=0.1)):
        with pytest.raises(ConfigError, match=r"the repetition penalty with a frequency or presence penalty has no"):
            SGLangKind(at).penalty_semantics(both, "hf")  # SGLang's own order changes between its starts
    assert SGLangKind(at).penalty_semantics(Penalties(frequency=0.4, presence=0.2), "hf") == "sglang"
    with pytest.raises(ConfigError, match="vLLM 0.33.0 at http://x: penalties .* for vLLM 0.32.x only"):
        VLLMKind(at).penalty_semantics(p, "hf")
    answers["/server_info"] = {"semantics": "vllm", "version": "0.1"}  # our serve says its own
    monkeypatch.setenv(API_KEY_ENV, "k")
    assert SGLangKind(at).penalty_semantics(p, "hf") == "vllm"
    assert sent[-1] == {"Authorization": "Bearer k"}  # a keyed engine answers the check (finding 10: it answered 401)


@pytest.mark.slow
@pytest.mark.processes
def test_ci_test_passes_with_penalties_through_serve(tiny_checkpoint, tmp_path, bias_file):
    from processes import engine_process

    ctx, url = engine_process(tiny_checkpoint, "--semantics", "vllm")
    with ctx:
        rows = train(
            run_config(
                tiny_checkpoint,
                tmp_path,
                num_rollout=2,
                rollout_max_response_len=24,
                rollout_url=url,
                sampling_semantics="vllm",
                rollout_repetition_penalty=1.3,
                rollout_frequency_penalty=0.3,
                rollout_presence_penalty=0.4,
                rollout_logit_bias=bias_file,
            )
        )
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and r["support_bytes_per_token"] > 0 for r in rows)
