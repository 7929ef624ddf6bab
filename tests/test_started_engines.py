"""The engines a run starts itself (Miles' launch flags): the servers' command lines, parsed by the servers'
own parsers (ours, and SGLang 0.5.23's from its wheel), and a two-rank run through two started engines."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from support_replay.cli import main
from support_replay.errors import ConfigError
from support_replay.started_engines import (
    check_serve_command,
    check_sglang_command,
    check_vllm_command,
    engine_command,
    engine_env,
)
from support_replay.train.config import RunConfig
from support_replay.train.launch_config import split_server_args

sys.path.insert(0, str(Path(__file__).parent / "engines"))

# the seed command's SGLang flags, less the one SGLang 0.5.23 does not have (refused by name, tested elsewhere)
SEED_SGLANG = [
    "--sglang-mem-fraction-static",
    "0.4",
    "--sglang-decode-log-interval",
    "1000",
    "--sglang-enable-deterministic-inference",
    "--sglang-attention-backend",
    "fa3",
]


def launched(**values) -> RunConfig:
    return RunConfig(**{"rollout_num_gpus_per_engine": 1, "hf_checkpoint": "/models/qwen3", **values})


def test_server_flags_are_split_off_with_their_values():
    argv = ["--lr", "1", "--sglang-mem-fraction-static", "0.4", "--sglang-enable-lora", "--sglang-dtype=bfloat16"]
    argv += ["--sglang-server-concurrency", "8", "--sglang-random-seed", "-3", "--", "--sglang-x"]
    rest, server = split_server_args(argv, known={"--sglang-server-concurrency"})
    assert server == ["--sglang-mem-fraction-static", "0.4", "--sglang-enable-lora", "--sglang-dtype=bfloat16"] + [
        "--sglang-random-seed",
        "-3",
    ]
    assert rest == ["--lr", "1", "--sglang-server-concurrency", "8", "--", "--sglang-x"]


@pytest.mark.float_bits
def test_the_serve_command_carries_the_run_and_the_server_flags(tmp_path):
    cfg = launched(sglang_server_args=("--sglang-max-running-requests", "16"), true_on_policy_mode=True)
    command = engine_command(cfg, "/models/qwen3", 4321, 0, tmp_path)
    assert command[1:4] == ["-m", "support_replay.cli", "serve"]
    joined = " ".join(command)
    for part in ("--port 4321", f"--weights-dir {tmp_path}", "--dtype float32", "--deterministic"):
        assert part in joined
    assert command[-2:] == ["--max-running-requests", "16"]
    check_serve_command(command)  # serve's own parser takes it


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sglang-enable-lora"], "--sglang-enable-lora: a flag of SGLang's server that support-replay serve does"),
        (["--sglang-port", "3"], "--sglang-port: each engine gets a free port"),
        (["--sglang-tp-size", "2"], "--sglang-tp-size: each engine's tensor-parallel size is"),
        (["--sglang-attention-backend", "fa3"], "--sglang-attention-backend: invalid choice: 'fa3'"),
        (["--sglang-mem-fraction-static", "lots"], "--sglang-mem-fraction-static: invalid float value"),
    ],
)
def test_a_server_flag_serve_cannot_honour_is_refused_by_name(flags, message, tmp_path):
    cfg = launched(sglang_server_args=tuple(flags))
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        check_serve_command(engine_command(cfg, "/m", 1, 0, tmp_path))


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--sglang-mem-fraction-static", "0.4"], "--sglang-mem-fraction-static: a flag of the server of the engines"),
        (["--launch-server", "sglang"], "--launch-server='sglang': sets the engines this run starts"),
        (["--rollout-num-gpus-per-engine", "1", "--rollout-url", "http://x:1"], "starts the engines itself"),
        (["--rollout-num-gpus-per-engine", "2"], "support-replay serve runs an engine in one process"),
        (["--rollout-num-gpus-per-engine", "2", "--rollout-num-gpus", "3", "--launch-server", "sglang"], "multiple"),
        (
            ["--rollout-num-gpus-per-engine", "1", "--launch-server", "sglang", "--true-on-policy-mode"],
            "--launch-server='sglang': true-on-policy mode checks the engine runs our batch-invariant kernels",
        ),
        (["--rollout-num-gpus-per-engine", "1", "--max-total-tokens", "99"], "the started engines take"),
        (
            ["--rollout-num-gpus-per-engine", "1", "--launch-server", "vllm", "--true-on-policy-mode"],
            "--launch-server='vllm': true-on-policy mode checks the engine runs our batch-invariant kernels",
        ),
        (
            ["--rollout-num-gpus-per-engine", "1", "--launch-server", "vllm", "--sglang-page-size", "8"],
            "--launch-server='vllm': --sglang-page-size is a flag of SGLang's server; give vLLM's server flags",
        ),
        (
            ["--rollout-num-gpus-per-engine", "1", "--vllm-enforce-eager"],
            "--vllm-enforce-eager: a flag of vLLM's server, for --launch-server vllm (not support-replay)",
        ),
        (["--launch-python", "/x/python", "--rollout-num-gpus-per-engine", "1"], "--launch-server sglang or vllm"),
    ],
)
def test_launch_settings_that_cannot_hold_are_refused_by_name(argv, message, capsys):
    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.processes
def test_the_sglang_command_line_parses_in_sglangs_own_parser(tmp_path):
    """The command the launch would run on a GPU machine, checked by SGLang 0.5.23's ``prepare_server_args`` in
    SGLang's own environment (make sglang)."""
    from sglang_env import SGLANG_PYTHON, sglang_missing

    if (why := sglang_missing()) is not None:
        pytest.skip(why)
    server = (*SEED_SGLANG, "--sglang-enable-lora", "--sglang-max-lora-rank", "16", "--sglang-lora-target-modules=all")
    server += ("--sglang-page-size", "16")
    sglang = dict(launch_server="sglang", launch_python=str(SGLANG_PYTHON))
    cfg = launched(**sglang, sglang_server_args=server, rollout_num_gpus_per_engine=2)
    command = engine_command(cfg, "/models/qwen3", 30001, 1, tmp_path)
    assert command[:3] == [str(SGLANG_PYTHON), "-m", "sglang.launch_server"]
    assert (
        " ".join(command[3:13])
        == "--model-path /models/qwen3 --host 127.0.0.1 --port 30001 --tp-size 2 --base-gpu-id 2"
    )
    check_sglang_command(command)
    wrong = launched(**sglang, sglang_server_args=("--sglang-attention-backend", "fa9"))
    with pytest.raises(ConfigError, match="SGLang's parser refuses the engines' command line: .*invalid choice: 'fa9'"):
        check_sglang_command(engine_command(wrong, "/m", 1, 0, tmp_path))


@pytest.mark.slow
@pytest.mark.processes
def test_two_trainer_ranks_train_through_the_two_engines_they_started(tiny_checkpoint, tmp_path):
    out = tmp_path / "run"
    flags = ["--hf-checkpoint", str(tiny_checkpoint), "--num-rollout", "2", "--rollout-batch-size", "2"]
    flags += ["--n-samples-per-prompt", "4", "--global-batch-size", "4", "--rollout-max-response-len", "10"]
    flags += ["--custom-rm-path", "rewards_for_tests:digit_share", "--rollout-top-p", "0.8", "--rollout-top-k", "32"]
    flags += ["--ci-test", "--no-progress", "--output-dir", str(out), "--colocate"]
    flags += ["--rollout-num-gpus-per-engine", "1", "--actor-num-nodes", "1", "--actor-num-gpus-per-node", "2"]
    flags += [
        "--sglang-decode-log-interval",
        "2",
        "--sglang-max-running-requests",
        "8",
        "--sglang-page-size",
        "8",
        "--sglang-server-concurrency",
        "4",
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    done = subprocess.run(
        [*torchrun, "-m", "support_replay.cli", "train", *flags], env=env, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "started 2 support-replay engine(s)" in done.stdout  # --colocate: one engine per actor rank
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout"] for r in rows] == [0, 1]
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in rows)
    logs = out / "logs"
    assert {p.name for p in logs.iterdir()} == {"engine0.log", "engine1.log", "router.log"}
    engine_logs = [(logs / f"engine{i}.log").read_text() for i in (0, 1)]
    assert all("--max-running-requests 8 --page-size 8" in log.splitlines()[0] for log in engine_logs)
    assert any("Decode batch, #running-req: " in log for log in engine_logs)  # --decode-log-interval 2
    written = json.loads((out / "config.json").read_text())  # as given: --config starts the engines again
    assert written["rollout_url"] is None and written["rollout_num_gpus_per_engine"] == 1
    assert written["sglang_server_args"][:2] == ["--sglang-decode-log-interval", "2"]
    assert written["sglang_server_concurrency"] == 4


PARTIAL_COUNTS = ("stopped_requests", "generated_tokens", "trained_tokens", "kept_tokens", "straddling_samples")


@pytest.mark.slow
@pytest.mark.processes
def test_a_run_launches_sglang_itself_and_trains_through_it(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    """The reference command's launch flags with --launch-server sglang: SGLang 0.5.23's own launch_server started
    by the run (from make sglang's environment) on its CPU path, GRPO with --ci-test and partial rollouts through it
    with more requests than its running limit (a stop of a queued request failed the run before); with the
    reference's --sglang-enable-deterministic-inference SGLang refuses to start, and the run stops quoting its reason:
    it admits deterministic inference only with attention backends that need a GPU or an NPU
    (arg_groups/choices.py: DETERMINISTIC_ATTENTION_BACKEND_CHOICES, checked in arg_groups/overrides.py)."""
    from sglang_env import SGLANG_PYTHON, sglang_missing

    if (why := sglang_missing()) is not None:
        pytest.skip(why)
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")  # SGLang's own opt-in to its CPU platform
    out = tmp_path / "run"
    flags = ["--hf-checkpoint", str(tiny_checkpoint), "--num-rollout", "2", "--rollout-batch-size", "2"]
    flags += ["--n-samples-per-prompt", "4", "--global-batch-size", "8", "--rollout-max-response-len", "10"]
    flags += ["--custom-rm-path", "rewards_for_tests:digit_share", "--rollout-top-p", "0.8", "--rollout-top-k", "32"]
    flags += ["--ci-test", "--no-progress", "--output-dir", str(out), "--rollout-num-gpus-per-engine", "1"]
    flags += ["--launch-server", "sglang", "--launch-python", str(SGLANG_PYTHON)]
    flags += ["--sglang-mem-fraction-static", "0.4", "--sglang-decode-log-interval", "1000"]  # the reference's
    flags += ["--sglang-device", "cpu", "--sglang-attention-backend", "torch_native"]  # SGLang's CPU path
    flags += ["--sglang-sampling-backend", "pytorch", "--sglang-disable-overlap-schedule"]
    flags += ["--sglang-max-total-tokens", "4096", "--sglang-skip-server-warmup", "--sglang-sleep-on-idle"]
    refused = subprocess.Popen(  # side by side with the run below: SGLang's start-up is mostly imports
        [sys.executable, "-m", "support_replay.cli", "train", *flags, "--output-dir", str(tmp_path / "refused"),
         "--sglang-enable-deterministic-inference"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )  # fmt: skip
    # partial rollouts with train's running limit (passed on to SGLang): the first rollout sends 4 groups of 4, 2
    # decoded at a time, so when its first 2 groups have finished at least 6 requests have not started, and the stop
    # finds them in SGLang's waiting queue (each answers empty: sent again next rollout), by construction
    partial = ["--partial-rollout", "--over-sampling-batch-size", "4", "--max-policy-lag", "1"]
    partial += ["--max-running-requests", "2", "--rollout-ignore-eos"]
    assert main(["train", *flags, *partial]) == 0, capsys.readouterr().err
    said = refused.communicate(timeout=300)[1]
    assert refused.returncode == 2 and "exited with 1" in said  # SGLang's launch_server stopped, its reason quoted:
    assert "attention backends are supported for deterministic inference" in said and "'torch_native'" in said
    assert "started 1 sglang engine(s)" in capsys.readouterr().out
    command = (out / "logs" / "engine0.log").read_text().splitlines()[0]
    assert command.startswith(f"$ {SGLANG_PYTHON} -m sglang.launch_server --model-path ")
    assert " --max-running-requests 2" in command
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["rollout"] for r in rows] == [0, 1]
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 and r["policy_lag_max"] <= 1 for r in rows)
    assert rows[0]["stopped_requests"] >= 6 and all(r.get("failed_samples", 0) == 0 for r in rows), rows
    generated = sum(r["generated_tokens"] for r in rows)
    assert generated == sum(r["trained_tokens"] for r in rows) + rows[-1]["kept_tokens"]  # 0 thrown away
    print("live SGLang partial rollouts:", [{k: r[k] for k in PARTIAL_COUNTS} for r in rows])


def test_the_sglang_command_carries_train_s_running_limit(tmp_path):
    """--launch-server sglang: train's --max-running-requests reaches SGLang (it was dropped without a word, so a
    partial rollout's over-sampling never queued there); given twice, once by its SGLang name, it is refused."""
    sglang = dict(launch_server="sglang", launch_python="/venv/bin/python", max_running_requests=2)
    command = engine_command(launched(**sglang), "/m", 30001, 0, tmp_path)
    assert command[:3] == ["/venv/bin/python", "-m", "sglang.launch_server"]
    assert " --max-running-requests 2" in " ".join(command) and command.count("--max-running-requests") == 1
    assert "--max-running-requests" not in engine_command(launched(launch_server="sglang"), "/m", 1, 0, tmp_path)
    twice = launched(**sglang, sglang_server_args=("--sglang-max-running-requests=4",))
    with pytest.raises(ConfigError, match="--sglang-max-running-requests: given beside --max-running-requests 2"):
        engine_command(twice, "/m", 1, 0, tmp_path)


def test_the_vllm_command_carries_the_run_the_client_s_needs_and_the_server_flags(tmp_path):
    """--launch-server vllm: vLLM's server as the trainer's vLLM client reads it, the trainer's own --vllm-* flags
    kept from the server's, a flag the launch sets refused by name."""
    argv = ["--vllm-capture", "processed_logprobs", "--vllm-max-model-len", "256", "--vllm-enforce-eager"]
    rest, server = split_server_args(argv, known={"--vllm-capture", "--vllm-endpoint"}, prefix="--vllm-")
    assert rest == ["--vllm-capture", "processed_logprobs"] and server == argv[2:]
    vllm = dict(launch_server="vllm", launch_python="/venv/bin/python", rollout_seed=7, max_running_requests=5)
    cfg = launched(**vllm, vllm_server_args=tuple(server), lora_rank=4, lora_sync="adapter")
    command = engine_command(cfg, "/models/qwen3", 30001, 1, tmp_path)
    assert command[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    joined = " ".join(command[3:])
    for part in (
        "--model /models/qwen3 --host 127.0.0.1 --port 30001 --tensor-parallel-size 1 --dtype float32 --seed 7",
        "--logprobs-mode processed_logprobs --max-logprobs -1 --enable-scale-out --max-num-seqs 5",
        "--enable-lora --max-lora-rank 4 --max-loras 1 --max-model-len 256 --enforce-eager",
    ):
        assert part in joined
    assert engine_env(cfg) == {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert cfg.with_rollout_url("http://127.0.0.1:9", 1).rollout_engine == "vllm"
    native = launched(**vllm, vllm_capture="native", vllm_endpoint="completions")
    native_command = engine_command(native, "/m", 1, 0, tmp_path)
    assert "--return-sampling-mask" in native_command and "--enable-scale-out" not in native_command
    with pytest.raises(ConfigError, match="--vllm-seed: the engines are seeded by --rollout-seed"):
        engine_command(launched(**vllm, vllm_server_args=("--vllm-seed", "3")), "/m", 1, 0, tmp_path)


@pytest.mark.processes
def test_a_python_without_vllm_is_refused_before_anything_starts(tmp_path):
    """--launch-python must name a Python with vLLM (this one has none): the check that parses the command line with
    vLLM's own parser says so (the parse itself runs in every ray-run with vLLM engines, tests/test_ray_run.py)."""
    cfg = launched(launch_server="vllm", launch_python=sys.executable)
    with pytest.raises(ConfigError, match="--launch-server=vllm: vLLM is not installed in .*--launch-python names"):
        check_vllm_command(engine_command(cfg, "/m", 1, 0, tmp_path))
