"""Every SPEC section 3 rule rejects with a message naming the flag and the value."""

import pytest

from support_replay.cli import build_parser
from support_replay.config import ConfigError, RunConfig, config_from_args


def cfg(*flags):
    return config_from_args(build_parser().parse_args(["train", *flags]))


def test_defaults_are_the_demo_and_derive_replay():
    c = cfg()
    assert c.rollout_top_p == 0.8 and c.rollout_top_k == 32 and c.use_sampling_support_replay
    assert not cfg("--rollout-top-p", "1.0", "--rollout-top-k", "-1").use_sampling_support_replay
    assert cfg("--rollout-min-p", "0.1").use_sampling_support_replay


@pytest.mark.parametrize("flags, message", [
    (["--rollout-top-p", "0"], r"--rollout-top-p=0.0: must be in \(0, 1\]"),
    (["--rollout-top-p", "1.5"], r"--rollout-top-p=1.5: must be in \(0, 1\]"),
    (["--rollout-top-k", "0"], "--rollout-top-k=0: must be -1"),
    (["--rollout-top-k", "-5"], "--rollout-top-k=-5: must be -1"),
    (["--rollout-temperature", "0"], "--rollout-temperature=0.0: must be > 0"),
    (["--rollout-temperature", "-1"], "--rollout-temperature=-1.0: must be > 0"),
    (["--rollout-top-k", "-1", "--rollout-top-p", "0.9"], "--rollout-top-p=0.9: a finite top-p or min-p needs a positive --rollout-top-k"),
    (["--rollout-top-k", "-1", "--rollout-top-p", "1", "--rollout-min-p", "0.1"], "--rollout-min-p=0.1: a finite top-p or min-p needs"),
    (["--rollout-frequency-penalty", "0.5"], "--rollout-frequency-penalty=0.5: the trainer cannot replay this logit transform"),
    (["--rollout-presence-penalty", "0.5"], "--rollout-presence-penalty=0.5: the trainer cannot replay"),
    (["--rollout-repetition-penalty", "1.1"], "--rollout-repetition-penalty=1.1: the trainer cannot replay"),
    (["--recompute-prefill-logprobs"], "--recompute-prefill-logprobs=True: prefill log-prob recomputation is not supported"),
    (["--rollout-top-k", "5000"], "--rollout-top-k=5000: exceeds --sampling-mask-max-tokens=4096"),
    (["--true-on-policy-mode", "--sampling-semantics", "hf"], "--sampling-semantics='hf': true-on-policy mode needs a deterministic sampler"),
    (["--global-batch-size", "5"], "--global-batch-size=5: must divide rollout_batch_size x n_samples_per_prompt = 16"),
    (["--micro-batch-size", "3"], "--micro-batch-size=3: must divide --global-batch-size=16"),
    (["--use-kl-loss"], "--kl-loss-coef=0.0: must be > 0 with --use-kl-loss"),
    (["--resume"], "--resume=True: needs --save"),
    (["--colocate", "--rollout-url", "http://127.0.0.1:1"], "--colocate=True: the in-process engine and --rollout-url"),
    (["--custom-rm-path", "nocolon"], "--custom-rm-path='nocolon': expected 'module:function'"),
    (["--lr", "-1"], "--lr=-1.0: Input should be greater than 0"),
])
def test_rejections(flags, message):
    with pytest.raises(ConfigError, match=message):
        cfg(*flags)


def test_penalties_are_fine_without_replay():
    c = cfg("--rollout-top-p", "1", "--rollout-top-k", "-1", "--rollout-frequency-penalty", "0.5")
    assert not c.use_sampling_support_replay


def test_kl_is_allowed_under_replay_with_two_scores():
    c = cfg("--use-kl-loss", "--kl-loss-coef", "0.01", "--kl-coef", "0.01")
    assert c.use_sampling_support_replay and c.needs_reference


def test_yaml_config_and_flag_override(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("rollout-top-k: 20\nnum_rollout: 7\n")
    c = cfg("--config", str(path), "--num-rollout", "3")
    assert c.rollout_top_k == 20 and c.num_rollout == 3
    saved = c.save_effective(tmp_path / "out")
    assert '"rollout_top_k": 20' in saved.read_text()
    path.write_text("rollout_top_q: 1\n")
    with pytest.raises(ConfigError, match="--rollout-top-q"):
        cfg("--config", str(path))


def test_derived_flag_cannot_be_set():
    assert RunConfig(use_sampling_support_replay=False).use_sampling_support_replay is True
