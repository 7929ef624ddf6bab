"""Every fail-closed rule (docs/contract.md) rejects, when the config is built, with a message
naming the flag and the value."""

import pytest

from support_replay.cli import build_parser
from support_replay.errors import ConfigError
from support_replay.train.config import RunConfig, config_from_args


def cfg(*flags):
    return config_from_args(build_parser().parse_args(["train", *flags]))


def test_defaults_are_the_demo_and_derive_replay():
    c = cfg()
    assert c.rollout_top_p == 0.8 and c.rollout_top_k == 32 and c.use_sampling_support_replay
    assert not cfg("--rollout-top-p", "1.0", "--rollout-top-k", "-1").use_sampling_support_replay
    assert cfg("--rollout-min-p", "0.1").use_sampling_support_replay


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--rollout-top-p", "0"], r"--rollout-top-p=0.0: must be in \(0, 1\]"),
        (["--rollout-top-p", "1.5"], r"--rollout-top-p=1.5: must be in \(0, 1\]"),
        (["--rollout-top-k", "0"], "--rollout-top-k=0: must be -1"),
        (["--rollout-top-k", "-5"], "--rollout-top-k=-5: must be -1"),
        (["--rollout-temperature", "0"], "--rollout-temperature=0.0: must be > 0"),
        (["--rollout-temperature", "-1"], "--rollout-temperature=-1.0: must be > 0"),
        (
            ["--rollout-top-k", "-1", "--rollout-top-p", "0.9"],
            "--rollout-top-p=0.9: a finite top-p or min-p needs a positive --rollout-top-k",
        ),
        (
            ["--rollout-top-k", "-1", "--rollout-top-p", "1", "--rollout-min-p", "0.1"],
            "--rollout-min-p=0.1: a finite top-p or min-p needs",
        ),
        (
            ["--rollout-repetition-penalty", "0"],
            r"--rollout-repetition-penalty=0.0: repetition_penalty: must be in \(0, 2\]",
        ),
        (
            ["--rollout-frequency-penalty", "0.5", "--sampling-semantics", "hf"],
            "--rollout-frequency-penalty=0.5: the hf semantics have no frequency",
        ),
        (["--rollout-logit-bias", "/nonexistent.json"], "--rollout-logit-bias='/nonexistent.json': .*No such file"),
        (["--rollout-top-k", "5000"], "--rollout-top-k=5000: exceeds --sampling-mask-max-tokens=4096"),
        (
            ["--true-on-policy-mode", "--sampling-semantics", "hf"],
            "--sampling-semantics='hf': true-on-policy mode needs a deterministic sampler",
        ),
        (
            ["--global-batch-size", "5"],
            "--global-batch-size=5: must divide rollout_batch_size x n_samples_per_prompt = 32",
        ),
        (["--micro-batch-size", "3"], "--micro-batch-size=3: must divide --global-batch-size=32"),
        (["--use-kl-loss"], "--kl-loss-coef=0.0: must be > 0 with --use-kl-loss"),
        (["--kl-loss-coef", "0.1"], "--kl-loss-coef=0.1: has no effect without --use-kl-loss"),
        (
            ["--use-tis", "--use-rollout-logprobs"],
            "--use-tis=True: with --use-rollout-logprobs the old policy is the rollout's own",
        ),
        (["--save-interval", "2"], "--save-interval=2: needs --save"),
        (
            ["--rollout-top-p", "1", "--rollout-top-k", "-1", "--ci-test"],
            "--ci-test=True: compares the trainer's log-probs with the rollout log mu, which only replay captures",
        ),
        (["--eval-prompt-data", "x.jsonl"], "--eval-prompt-data='x.jsonl': has no effect without --eval-interval"),
        (
            ["--rollout-top-p", "1", "--rollout-top-k", "-1", "--rollout-frequency-penalty", "0.5"],
            "--rollout-frequency-penalty=0.5: penalties and logit bias are replayed on the captured support only",
        ),
        (["--resume"], "--resume=True: needs --save"),
        (
            ["--colocate", "--rollout-url", "http://127.0.0.1:1"],
            "--colocate=True: the in-process engine and --rollout-url",
        ),
        (["--custom-rm-path", "nocolon"], "--custom-rm-path='nocolon': expected 'module:function'"),
        (["--lr", "-1"], "--lr=-1.0: Input should be greater than 0"),
        (
            ["--true-on-policy-mode", "--train-dtype", "bfloat16"],
            "--train-dtype='bfloat16': true-on-policy mode computes the same bits on both sides, so in one dtype",
        ),
    ],
)
def test_rejections(flags, message):
    with pytest.raises(ConfigError, match=message):
        cfg(*flags)


def test_rejections_also_hold_when_built_in_python():
    """No separate check to forget: constructing the config is what validates it."""
    with pytest.raises(ConfigError, match="--rollout-top-k=0: must be -1"):
        RunConfig(rollout_top_k=0)
    with pytest.raises(ConfigError, match="--micro-batch-size=3: must divide --global-batch-size=32"):
        RunConfig(micro_batch_size=3)


def test_micro_batch_default_divides_any_global_batch():
    # a user who passes only --global-batch-size never hears about --micro-batch-size
    for global_batch, micro in [(16, 8), (4, 4), (12, 6), (5, 5), (24, 8), (7, 7), (11, 1)]:
        c = cfg(
            "--rollout-batch-size",
            str(global_batch),
            "--n-samples-per-prompt",
            "1",
            "--global-batch-size",
            str(global_batch),
        )
        assert c.micro_batch == micro and global_batch % c.micro_batch == 0
    assert cfg("--micro-batch-size", "2").micro_batch == 2


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
    with pytest.raises(
        ConfigError, match="--use-sampling-support-replay=False: is derived from the rollout sampling settings"
    ):
        RunConfig(use_sampling_support_replay=False)


def test_flag_table_in_the_docs_is_current():
    from pathlib import Path

    from support_replay.train.config import flag_table

    docs = (Path(__file__).parents[2] / "docs" / "training.md").read_text()
    assert flag_table() in docs, (
        "docs/training.md: regenerate the flag table with support_replay.train.config.flag_table()"
    )


def test_the_docs_list_the_loops_steps_in_its_order():
    """docs/training.md's numbered steps are the numbered step comments of train/loop.py, in order."""
    import re
    from pathlib import Path

    root = Path(__file__).parents[2]
    loop = (root / "src" / "support_replay" / "train" / "loop.py").read_text()
    docs = (root / "docs" / "training.md").read_text()
    section = docs[docs.index("## What one step does") : docs.index("## `--ci-test`")]
    in_loop = re.findall(r"# (\d+)\. (\w+)", loop)
    in_docs = [(n, name.lower()) for n, name in re.findall(r"^(\d+)\. \*\*(\w+)\*\*", section, re.M)]
    assert in_loop == in_docs and len(in_loop) == 9, (in_loop, in_docs)


def test_sections_validate_their_own_fields_and_a_written_config_reads_back(tmp_path):
    c = cfg("--lr", "3e-4", "--rollout-top-k", "16", "--max-policy-lag", "1", "--async-rollout")
    assert c.optimizer.lr == 3e-4 and c.rollout.rollout_top_k == 16 and c.production.async_rollout
    assert c.lr == c.optimizer.lr and c.rollout.sampling_params.top_k == 16  # one SamplingParams, built once
    saved = c.save_effective(tmp_path / "out")
    assert cfg("--config", str(saved)) == c  # flat flag keys, the derived switch included, read back
    saved.write_text(
        saved.read_text().replace('"use_sampling_support_replay": true', '"use_sampling_support_replay": false')
    )
    with pytest.raises(ConfigError, match="--use-sampling-support-replay=False: is derived"):
        cfg("--config", str(saved))


def test_help_groups_the_flags_by_section():
    from support_replay.train.sections import SECTIONS

    parser = build_parser()
    train = next(a for a in parser._subparsers._group_actions[0].choices.values() if "--lr" in a.format_help())
    text = train.format_help()
    positions = [text.index(f"{cls.TITLE}:") for cls in SECTIONS.values()]
    assert positions == sorted(positions)
    assert text.index("optimizer and loss:") < text.index("\n  --lr LR") < text.index("replay and checks:")


def test_the_global_batch_is_derived_as_miles_and_slime_derive_it():
    assert cfg().global_batch_size == 32 and cfg().optimizer_steps == 20  # 8 prompts x 4 samples, one step each
    assert cfg("--rollout-batch-size", "2", "--n-samples-per-prompt", "2").global_batch_size == 4
    assert cfg("--num-steps-per-rollout", "4").global_batch_size == 8
    assert cfg("--global-batch-size", "16").global_batch_size == 16
    assert cfg("--num-steps-per-rollout", "2", "--global-batch-size", "16").global_batch_size == 16
    with pytest.raises(ConfigError, match="--num-steps-per-rollout=3: must divide rollout_batch_size x n_samples_per"):
        cfg("--num-steps-per-rollout", "3")
    with pytest.raises(ConfigError, match="--global-batch-size=8: differs from .* = 16; give one of them"):
        cfg("--num-steps-per-rollout", "2", "--global-batch-size", "8")


def test_a_flag_that_does_nothing_with_prompt_data_is_refused(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "1+1=", "label": "2"}\n')
    assert cfg("--task-max-operand", "20").data.max_operand == 20 and cfg().data.max_operand == 10
    with pytest.raises(ConfigError, match=f"--task-max-operand=20: sets the built-in task; --prompt-data='{data}'"):
        cfg("--prompt-data", str(data), "--task-max-operand", "20")
