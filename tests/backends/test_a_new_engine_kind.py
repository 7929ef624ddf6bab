"""A new engine kind is one class written against ``backends/kind.py`` and one registry line: the trainer and the
audit reach it through ``--rollout-engine NAME`` with no file under ``train/`` or ``audit/`` knowing its name."""

import pytest

from recipe_helpers import run_config
from support_replay.audit import AuditSettings, run_audit
from support_replay.backends import registry
from support_replay.backends.kind import EngineKind, Needs, WeightRoute
from support_replay.backends.local import EngineBackend
from support_replay.engine import Engine
from support_replay.errors import ConfigError
from support_replay.train import train


class Recorder:
    """A backend that keeps a log of what it was asked, in front of an engine of its own."""

    def __init__(self, engine, log):
        self.inner, self.log = EngineBackend(engine), log
        self.vocab_size, self.retries = self.inner.vocab_size, 0

    def generate(self, requests, *, return_exceptions=False):
        self.log.append(("generate", len(requests)))
        return self.inner.generate(requests, return_exceptions=return_exceptions)


class RecordingKind(EngineKind):
    """The kind a user would add: its backend, its handshake, its weight push, its refusals."""

    name = "recording"
    log: list = []

    @classmethod
    def refusal(cls, settings, *, score_centering):
        return ("use_score_centering", True, "the recording engine reports no log q") if score_centering else None

    def connect(self, needs: Needs):
        built = self.in_process  # this test's engine runs the run's checkpoint, in this process
        self.engine = Engine.from_pretrained(built.checkpoint, built.settings.but(weight_version=needs.weight_version))
        self.backend = Recorder(self.engine, self.log)
        return self.backend

    def identity(self):
        return {"name": "recording", "url": self.settings.rollout_url, "version": "1", "semantics": "sglang"}

    def penalty_semantics(self, penalties, fallback):
        return fallback

    def weight_sync(self, route: WeightRoute):
        kind = self

        class Push:
            def push(self, state, version):
                kind.log.append(("push", version))
                update = kind.engine.update_weights(state, version)
                kind.engine.wait([update])
                update.result()

        return Push()


@pytest.fixture
def recording(monkeypatch):
    monkeypatch.setattr(registry, "_REGISTERED", {})
    monkeypatch.setattr(RecordingKind, "log", [])
    registry.register(RecordingKind)  # the one line
    return RecordingKind


def test_a_registered_kind_trains_with_ci_test_and_takes_every_push(tiny_checkpoint, tmp_path, recording):
    cfg = run_config(tiny_checkpoint, tmp_path, rollout_url="recording://here", rollout_engine="recording")
    rows = train(cfg)
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)
    generated = [n for what, n in recording.log if what == "generate"]
    pushes = [v for what, v in recording.log if what == "push"]
    assert sum(generated) == 3 * 2 * 4  # three rollouts of 2 prompts x 4 samples, all through the new kind
    assert len(pushes) == 4  # the starting weights (an engine of its own) and one push per rollout


def test_a_registered_kind_is_audited_and_refuses_what_it_cannot_serve(tiny_checkpoint, tmp_path, recording):
    cfg = run_config(tiny_checkpoint, tmp_path, rollout_url="recording://here", rollout_engine="recording")
    report = run_audit(cfg, AuditSettings())
    assert report["engine"]["name"] == "recording" and report["verdict"]["pass"], report.get("verdict")
    assert recording.log and recording.log[0][0] == "generate"
    with pytest.raises(ConfigError, match="--use-score-centering=True: the recording engine reports no log q"):
        run_config(
            tiny_checkpoint,
            tmp_path,
            rollout_url="x",
            rollout_engine="recording",
            use_score_centering=True,
            policy_loss="reinforce",
        )


def test_an_unknown_kind_is_refused_by_name(tiny_checkpoint, tmp_path):
    with pytest.raises(ConfigError, match="--rollout-engine='nowhere': one of \\['sglang', 'vllm'\\]"):
        run_config(tiny_checkpoint, tmp_path, rollout_url="http://x", rollout_engine="nowhere")
