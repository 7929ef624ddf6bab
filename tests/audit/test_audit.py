"""``support-replay audit`` end to end on the in-process engine with the tiny model: the split by cause,
the certificate, the findings, the report read back and the exit status."""

from dataclasses import replace

import pytest

from support_replay.audit import AuditSettings, run_audit
from support_replay.audit.report import read
from support_replay.audit.settings import TRAINING_ONLY
from support_replay.backends.in_process import InProcessKind
from support_replay.cli import main
from support_replay.protocol import Completion, validate_completion
from support_replay.train.config import FIELD_SECTION, RunConfig

SHORT = dict(rollout_batch_size=4, n_samples_per_prompt=4, rollout_max_response_len=16)


def audit_config(checkpoint, tmp_path, **overrides) -> RunConfig:
    values = dict(
        SHORT,
        hf_checkpoint=str(checkpoint),
        output_dir=str(tmp_path / "audit"),
        rollout_top_p=0.8,
        rollout_top_k=32,
        progress=False,
    )
    return RunConfig(**{**values, **overrides})


@pytest.mark.float_bits
def test_truncation_is_the_whole_full_vocabulary_bias_and_replay_is_certified(tiny_checkpoint, tmp_path):
    cfg = audit_config(tiny_checkpoint, tmp_path)
    report = run_audit(cfg, AuditSettings())
    causes = report["causes"]
    assert causes["truncation"]["share"] > 0.95 and causes["truncation"]["mean"] < 0
    assert causes["penalties"]["max_abs"] == 0.0
    scorings = report["scorings"]
    assert not scorings["full_vocabulary"]["pass"] and scorings["support_replay"]["pass"]
    assert scorings["trainer"]["pass"] and report["verdict"] == {"pass": True, "reasons": []}
    assert report["findings"] == [] and report["boundary_flips"]["checked"]
    # our engine says what it sampled with, and it is what the run declares
    (record,) = report["settings"]["observed"]["sampler_records"]
    assert record["engine"] == "support-replay" and record["top_p"] == 0.8 and record["top_k"] == 32
    assert report["settings"]["sent"] == ["top_k", "top_p"]  # what differs from the neutral values
    assert abs(report["settings"]["observed"]["temperature"]["fitted"] - 1.0) < 1e-3
    # the report reads back, with its documented keys, and the plot is there
    back = read(tmp_path / "audit" / "audit.json")
    assert back == report
    for key in ("engine", "settings", "causes", "scorings", "findings", "worst_tokens", "thresholds", "verdict"):
        assert key in back
    assert len(back["worst_tokens"]["total"]) == 10 and {"sample", "position", "truncation"} <= set(
        back["worst_tokens"]["total"][0]
    )
    assert (tmp_path / "audit" / "audit.png").stat().st_size > 0
    assert report["thresholds"] == {"max_mismatch_kl": 1e-4, "max_abs_logprob_diff": 1e-3}


def test_a_repetition_penalty_shows_and_replay_without_it_fails(tiny_checkpoint, tmp_path):
    cfg = audit_config(tiny_checkpoint, tmp_path, rollout_repetition_penalty=1.5)
    report = run_audit(cfg, AuditSettings())
    assert report["causes"]["penalties"]["share"] > 0.01
    scorings = report["scorings"]
    assert not scorings["support_replay"]["pass"]  # replay of the support without the penalty
    assert scorings["support_replay_with_penalties"]["pass"] and report["verdict"]["pass"]
    assert report["settings"]["sent"] == ["repetition_penalty", "top_k", "top_p"]
    assert not report["boundary_flips"]["checked"]


@pytest.mark.float_bits
def test_true_on_policy_mode_has_no_numerics_at_all(tiny_checkpoint, tmp_path):
    cfg = audit_config(tiny_checkpoint, tmp_path, true_on_policy_mode=True)
    report = run_audit(cfg, AuditSettings())
    numerics = report["causes"]["numerics"]
    assert numerics["max_abs"] == 0.0 and numerics["share"] == 0.0
    assert report["scorings"]["trainer"]["abs_diff_max"] == 0.0
    assert report["thresholds"] == {"max_mismatch_kl": 0.0, "max_abs_logprob_diff": 0.0} and report["verdict"]["pass"]


class HotterEngine:
    """A stand-in engine that samples at temperature 0.7 whatever a request says. ``record``: it still sends
    our sampler record (a proxy rewrote the request on its way), checked where it enters as every backend
    does; else none, as SGLang and vLLM."""

    def __init__(self, inner, record: bool):
        self.inner, self.record, self.vocab_size = inner, record, inner.vocab_size

    @property
    def retries(self) -> int:
        return self.inner.retries

    def generate(self, requests, *, return_exceptions=False):
        hot = [replace(r, params=replace(r.params, temperature=0.7)) for r in requests]
        out = self.inner.generate(hot, return_exceptions=return_exceptions)
        for req, c in zip(requests, out):
            if isinstance(c, Completion):
                if self.record:
                    validate_completion(c, req, self.vocab_size)
                c.sampler = None
        return out


@pytest.fixture
def hotter_engine(monkeypatch):
    def use(record: bool):
        connect = InProcessKind.connect

        def hot(kind, needs):
            return HotterEngine(connect(kind, needs), record)

        monkeypatch.setattr(InProcessKind, "connect", hot)

    return use


def test_an_engine_sampling_at_another_temperature_is_caught_by_name(tiny_checkpoint, tmp_path, hotter_engine):
    hotter_engine(record=False)
    report = run_audit(audit_config(tiny_checkpoint, tmp_path), AuditSettings())
    named = [f for f in report["findings"] if f["setting"] == "temperature"]
    assert named and "0.7000" in named[0]["evidence"], report["findings"]
    # compared at the temperature that sampled them, the supports are the declared filters': nothing else is found
    assert len(report["findings"]) == 1 and abs(report["boundary_flips"]["temperature"] - 0.7) < 1e-3
    assert abs(report["settings"]["observed"]["temperature"]["fitted"] - 0.7) < 1e-3
    assert not report["verdict"]["pass"] and any(r.startswith("temperature:") for r in report["verdict"]["reasons"])


def test_a_sampler_record_that_disagrees_fails_the_audit_closed(tiny_checkpoint, tmp_path, hotter_engine):
    hotter_engine(record=True)
    report = run_audit(audit_config(tiny_checkpoint, tmp_path), AuditSettings())
    assert not report["verdict"]["pass"] and report["findings"][0]["setting"] == "sampler"
    assert "temperature=0.7" in report["error"] and "the run's is 1.0" in report["error"]
    assert read(tmp_path / "audit" / "audit.json")["verdict"]["pass"] is False


def test_the_exit_status_is_the_verdict(tiny_checkpoint, tmp_path, capsys):
    flags = ["audit", "--hf-checkpoint", str(tiny_checkpoint), "--output-dir", str(tmp_path / "cli"), "--no-progress"]
    flags += [f"--{k.replace('_', '-')}={v}" for k, v in SHORT.items()]
    assert main(flags) == 0
    assert "PASS" in capsys.readouterr().out
    assert main([*flags, "--max-abs-logprob-diff", "0"]) == 1  # fp32 numerics are not zero
    out = capsys.readouterr().out
    assert "FAIL: max |log pi - log mu|" in out and "--max-abs-logprob-diff 0" in out
    assert main([*flags, "--tensor-model-parallel-size", "2"]) == 2  # refused by name
    assert "--tensor-model-parallel-size" in capsys.readouterr().err


def test_routing_and_weight_versions_are_checked(tiny_moe_checkpoint, tmp_path):
    cfg = audit_config(tiny_moe_checkpoint, tmp_path, use_rollout_routing_replay=True)
    report = run_audit(cfg, AuditSettings(expected_weight_version="7"))
    routing = report["routing"]
    assert routing["replayed"] and routing["choices_compared"] > 0
    assert routing["agreement"] == 1.0 and routing["choices_differing"] == 0  # the same weights route the same
    (stale,) = [f for f in report["findings"] if f["setting"] == "weight_version"]
    assert "expected every token from weights '7'" in stale["evidence"] and "by 'default'" in stale["evidence"]
    assert report["staleness"]["tokens_by_version"] == {"default": report["tokens"]} and not report["verdict"]["pass"]


@pytest.mark.slow
@pytest.mark.processes
def test_the_audit_of_a_server_answering_as_sglang(tiny_checkpoint, tmp_path):
    """SGLang's own sampler and payload code (tests/engines/sglang_standin.py) behind --rollout-url."""
    from processes import sglang_standin_process

    standin, url = sglang_standin_process(tiny_checkpoint)
    with standin:
        report = run_audit(audit_config(tiny_checkpoint, tmp_path, rollout_url=url), AuditSettings())
    assert report["engine"]["name"] == "sglang" and report["settings"]["observed"]["sampler_records"] == []
    assert report["causes"]["truncation"]["share"] > 0.95 and report["verdict"]["pass"], report["verdict"]
    assert report["findings"] == [] and report["boundary_flips"]["checked"]


@pytest.mark.slow
def test_the_audit_of_the_real_sglang_server(sglang_server, tmp_path):
    """SGLang 0.5.23 itself (make sglang): truncation named as the whole full-vocabulary bias, replay certified."""
    url, ckpt = sglang_server
    report = run_audit(audit_config(ckpt, tmp_path, rollout_url=url), AuditSettings())
    assert report["engine"]["name"] == "sglang" and report["engine"]["version"] == "0.5.23"
    assert report["causes"]["truncation"]["share"] > 0.95 and report["verdict"]["pass"], report["verdict"]
    assert report["findings"] == []


def test_bad_flags_and_an_unreachable_engine_are_errors_by_name(tiny_checkpoint, tmp_path, capsys):
    base = ["audit", "--hf-checkpoint", str(tiny_checkpoint), "--output-dir", str(tmp_path / "cli")]
    assert main([*base, "--max-mismatch-kl", "-1"]) == 2
    assert "--max-mismatch-kl=-1.0" in capsys.readouterr().err
    assert main([*base, "--rollout-top-k", "-1", "--rollout-top-p", "1.0"]) == 2  # nothing bounds the support
    assert "only vLLM's processed log-probs reveal" in capsys.readouterr().err
    assert main([*base, "--rollout-url", "http://127.0.0.1:9"]) == 2
    assert "--rollout-url http://127.0.0.1:9: no usable answer" in capsys.readouterr().err
    assert not (tmp_path / "cli" / "audit.json").exists()  # nothing half-written


def test_an_audit_of_two_prompts_by_two_runs_without_batch_flags(tiny_checkpoint, tmp_path):
    cfg = RunConfig(
        hf_checkpoint=str(tiny_checkpoint),
        output_dir=str(tmp_path / "audit"),
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        rollout_max_response_len=8,
        progress=False,
    )
    report = run_audit(cfg, AuditSettings())
    assert report["verdict"]["pass"] and report["tokens"] > 0, report.get("verdict")


def test_train_flags_that_only_training_reads_are_left_out_of_the_audit(tiny_checkpoint, tmp_path, capsys):
    """A launch command with ``train`` swapped for ``audit`` runs: a training rule (a batch that must divide the
    rollout) stops ``train`` by name, and the audit, which never steps an optimizer, says what it left out."""
    flags = ["--hf-checkpoint", str(tiny_checkpoint), "--output-dir", str(tmp_path / "cli"), "--no-progress"]
    flags += ["--rollout-batch-size", "2", "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8"]
    flags += ["--global-batch-size", "3", "--lr", "1e-5"]
    assert main(["train", *flags]) == 2
    assert "--global-batch-size=3: must divide rollout_batch_size x n_samples_per_prompt = 4" in capsys.readouterr().err
    assert main(["audit", *flags]) == 0
    assert "the audit does not train; left out: --global-batch-size, --lr" in capsys.readouterr().err
    assert TRAINING_ONLY <= set(FIELD_SECTION)  # each name a setting of the run
