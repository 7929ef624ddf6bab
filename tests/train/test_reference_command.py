"""The reference implementation's own end-to-end command (its FSDP true-on-policy test: a gsm8k parquet of chat
messages, top_p 0.8 / top_k 32, --true-on-policy-mode --ci-test), paths changed: every flag either works
with its meaning here or is refused by name, and after removing only the flags our refusals name it runs,
bitwise."""

import re
import shlex

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from support_replay.cli import main

# tests/../shared/reference: the command of the seed's test, as written there (paths and model aside)
REFERENCE = """
--hf-checkpoint {checkpoint}
--prompt-data {data} --input-key messages --label-key label --apply-chat-template --rm-type math
--num-rollout 5 --rollout-batch-size 4 --n-samples-per-prompt 4 --rollout-max-response-len 1024
--rollout-temperature 1 --rollout-top-p 0.8 --rollout-top-k 32 --global-batch-size 16
--optimizer adam --lr 1e-6 --lr-decay-style constant --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.98
--advantage-estimator grpo --kl-loss-coef 0.00 --kl-coef 0.00 --entropy-coef 0.00
--train-backend fsdp --update-weight-buffer-size 536870912
--rollout-num-gpus-per-engine 1 --sglang-mem-fraction-static 0.4 --sglang-decode-log-interval 1000
--sglang-enable-deterministic-inference --sglang-true-on-policy-contract qwen3_dense_true_on_policy_v1
--sglang-attention-backend fa3 --attn-implementation flash_attention_3 --deterministic-mode --true-on-policy-mode
--use-wandb --wandb-project support-replay-ci --wandb-group reference --wandb-mode offline
--ci-test --actor-num-nodes 1 --actor-num-gpus-per-node 2 --colocate
"""
# what CI can afford on the tiny model (the full command ran on SmolLM2: docs/training.md); argparse takes the last
SHORTER = ["--num-rollout", "2", "--rollout-max-response-len", "24", "--output-dir"]
NAMED = re.compile(r"^\s*(?:support-replay: error: )?(--[a-z0-9-]+)", re.MULTILINE)


def gsm8k_parquet(path):
    questions = [f"Natalia sold {a} clips in April and {b} in May. How many clips did she sell?" for a, b in
                 [(48, 24), (12, 30), (7, 8), (100, 5)]]  # fmt: skip
    table = pa.table(
        {
            "messages": [[{"role": "user", "content": q}] for q in questions],
            "label": ["72", "42", "15", "105"],
        }
    )
    pq.write_table(table, path)
    return path


def without(tokens: list[str], flag: str) -> list[str]:
    """``tokens`` without ``flag`` and its value, if it has one."""
    i = tokens.index(flag)
    takes_value = i + 1 < len(tokens) and not tokens[i + 1].startswith("--")
    return tokens[:i] + tokens[i + 1 + takes_value :]


@pytest.mark.float_bits
@pytest.mark.slow  # the whole reference command: the main pass runs it, the kernel-set reruns leave it
@pytest.mark.processes
def test_the_reference_command_runs_once_the_refused_flags_are_removed(tiny_agent_checkpoint, tmp_path, capsys):
    data = gsm8k_parquet(tmp_path / "train.parquet")
    tokens = shlex.split(REFERENCE.format(checkpoint=tiny_agent_checkpoint, data=data))
    tokens += [*SHORTER, str(tmp_path / "out")]
    removed = []
    for _ in range(6):
        code = main(["train", *tokens])
        if code != 2:
            break
        named = [f for f in NAMED.findall(capsys.readouterr().err) if f in tokens]
        assert named, "a refusal that names no flag of the command"
        for flag in named:
            tokens = without(tokens, flag)
        removed += named
    assert code == 0, capsys.readouterr().err
    # refused, each by name: the weight buffer, a flag SGLang 0.5.23 does not have, FlashAttention 3 on a CPU (the
    # engines' and the trainer's) and the 2-GPU layout in a 1-process run; everything else worked with its
    # meaning: the run started a serve engine with --mem-fraction-static 0.4, --decode-log-interval 1000 and
    # --enable-deterministic-inference
    assert sorted(removed) == sorted(
        [
            "--update-weight-buffer-size",
            "--sglang-true-on-policy-contract",
            "--sglang-attention-backend",
            "--attn-implementation",
            "--actor-num-gpus-per-node",
            "--actor-num-nodes",
        ]
    )
    command = (tmp_path / "out" / "logs" / "engine0.log").read_text().splitlines()[0]
    assert " serve " in command  # and --true-on-policy-mode found it deterministic (rollouts._require_deterministic)
    for given in ("--mem-fraction-static 0.4", "--decode-log-interval 1000", "--enable-deterministic-inference"):
        assert given in command
    rows = [__import__("json").loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["train_rollout_logprob_abs_diff_max"] == 0.0 for r in rows)  # bitwise
    assert all(r["lr"] == 1e-6 for r in rows)


def test_refusals_are_reported_all_at_once(capsys):
    argv = ["train", "--sglang-true-on-policy-contract", "v1", "--update-weight-buffer-size=1024", "--lr", "1"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "--sglang-true-on-policy-contract: not a flag of SGLang 0.5.23's server" in err
    assert "--update-weight-buffer-size: weights reach the engine whole" in err


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--train-backend", "megatron"], "--train-backend='megatron': the trainer is FSDP2"),
        (["--attn-implementation", "flash_attention_2"], "FlashAttention needs CUDA"),
        (["--attn-implementation", "eager", "--true-on-policy-mode"], "runs the engine's batch-invariant attention"),
        (["--actor-num-nodes", "1"], "give --actor-num-nodes and --actor-num-gpus-per-node together"),
    ],
)
def test_reference_settings_that_cannot_hold_are_refused_by_name(flags, message, capsys):
    assert main(["train", *flags]) == 2
    assert message in capsys.readouterr().err


def test_eager_attention_trains_the_same_run(tiny_checkpoint, tmp_path):
    from recipe_helpers import run_config
    from support_replay.train import train

    rows = train(run_config(tiny_checkpoint, tmp_path, num_rollout=2, attn_implementation="eager"))
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)  # --ci-test held on every rollout
