"""GRPO step time on SmolLM2-135M-Instruct, broken into generate / score / update / sync,
with TRL's GRPOTrainer doing the same work side by side when it is installed.

    python bench/e2e.py [--steps 4] [--skip-trl]
    python bench/e2e.py --async-compare [--steps 4]
    python bench/e2e.py --dtype bfloat16 --skip-trl
    python bench/e2e.py --with-bf16            # ours fp32, ours bf16 and TRL, one sitting
    python bench/e2e.py --rounds 3             # the same three alternating, medians of the rounds
    python bench/e2e.py --trl-precision bf16-autocast   # TRL at GRPOConfig's own default precision (bf16=True)
    python bench/e2e.py --true-on-policy-compare --skip-trl   # the normal step, then true-on-policy

``--async-compare`` runs the same work twice through ``support-replay serve`` over HTTP, with
the engine pinned to core 0 and the trainer to core 1 (one thread each): synchronous, then
``--async-rollout --max-policy-lag 1``; and estimates, from the synchronous run's phase times,
the step of an asynchronous run whose engine and trainer sit on separate devices.

The work of one step: 4 prompts x 4 samples of the built-in arithmetic task, up to 64 new
tokens, temperature 1, top_p 0.8, top_k 32, one optimizer step (lr 1e-6). Ours runs with
sampling-support replay and --ci-test on. The first step of each side is a warm-up and is
left out of the means. TRL runs in fp32 (``bf16=False``: GRPOConfig's own default is ``bf16=True``, a forward
under CPU autocast to bf16) with its other defaults, gradient checkpointing included.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.modeling.kernel_probe import cpu_identity
from support_replay.modeling.linear_kernels import slow_bf16
from support_replay.rollout import ArithmeticTask, math_reward
from support_replay.train import train
from support_replay.train.config import RunConfig

SETTINGS = dict(
    task_max_operand=20,
    rollout_batch_size=4,
    n_samples_per_prompt=4,
    rollout_max_response_len=64,
    rollout_temperature=1.0,
    rollout_top_p=0.8,
    rollout_top_k=32,
)


def ours(steps: int, micro_batch: int | None, **options) -> list[dict]:
    """Our run of the work (``run_config``'s options); its metrics rows."""
    return train(run_config(steps, micro_batch, **options))


def run_config(
    steps: int,
    micro_batch: int | None,
    true_on_policy: bool = False,
    full_vocab_metrics_interval: int = 1,
    dtype: str = "float32",
    max_tokens: int | None = None,
    packed: str = "auto",
    linear_kernel: str = "auto",
) -> RunConfig:
    out = tempfile.mkdtemp(prefix="bench-e2e-")
    return RunConfig(
        num_rollout=steps,
        global_batch_size=16,
        micro_batch_size=None if max_tokens else micro_batch,
        max_tokens_per_micro_batch=max_tokens,
        true_on_policy_mode=true_on_policy,
        lr=1e-6,
        ci_test=True,
        output_dir=out,
        progress=False,
        packed_scoring=packed,
        full_vocab_metrics_interval=full_vocab_metrics_interval,
        rollout_dtype=dtype,
        train_dtype=dtype,
        linear_kernel=linear_kernel,
        **SETTINGS,
    )


PHASES = ("time_generate", "time_score", "time_update", "time_sync", "time_step")


def print_steps(name: str, rows: list[dict]) -> dict[str, float]:
    """The per-step table of one run; returns the means of steps 1+ (step 0 is the warm-up)."""
    print(
        f"\n{name}\n\n| step | generate s | score s | update s | sync s | total s | response len | max abs(log pi - "
        "log mu) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['rollout']} | {r['time_generate']:.2f} | {r['time_score']:.2f} | {r['time_update']:.2f} | "
            f"{r['time_sync']:.2f} | {r['time_step']:.2f} | {r['response_len_mean']:.1f} | "
            f"{r['train_rollout_logprob_abs_diff_max']:.1e} |"
        )
    steady = rows[1:] or rows
    mean = {k: statistics.mean(r[k] for r in steady) for k in PHASES}
    print(
        f"| mean (steps 1+) | {mean['time_generate']:.2f} | {mean['time_score']:.2f} | {mean['time_update']:.2f} | "
        f"{mean['time_sync']:.2f} | {mean['time_step']:.2f} | | |"
    )
    return mean


def pinned_runs(steps: int) -> dict[str, list[dict]]:
    """Synchronous and asynchronous GRPO through a serve process on core 0, the trainer on core 1."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
    from processes import free_port, wait_healthy

    root = Path(tempfile.mkdtemp(prefix="bench-async-"))
    checkpoint = smollm2_checkpoint()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    log = open(root / "serve.log", "w")
    engine = subprocess.Popen(
        [
            "taskset",
            "-c",
            "0",
            sys.executable,
            "-m",
            "support_replay.cli",
            "serve",
            "--hf-checkpoint",
            str(checkpoint),
            "--port",
            str(port),
            "--weights-dir",
            str(root),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
    )
    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    runs = {}
    try:
        wait_healthy(url, engine, timeout=300)
        lag = dict(async_rollout=True, max_policy_lag=1)
        for name, extra in (
            ("synchronous", {}),
            ("async, lag 1", lag),
            ("async, lag 1, no --ci-test", dict(lag, ci_test=False)),
        ):
            cfg = RunConfig(
                num_rollout=steps,
                global_batch_size=16,
                micro_batch_size=8,
                lr=1e-6,
                output_dir=str(root / name.replace(" ", "").replace(",", "-")),
                progress=False,
                rollout_url=url,
                **{"ci_test": True, **SETTINGS, **extra},
            )
            runs[name] = train(cfg)
    finally:
        engine.terminate()
        engine.wait(timeout=30)
        log.close()
    return runs


def print_async_compare(runs: dict[str, list[dict]]) -> None:
    print(
        "\n| run (engine core 0, trainer core 1) | generate s | wait for rollout s | score s | update s | of which "
        "lagged --ci-test s | sync s | step s | lag max | max abs(log pi - log mu) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    means = {}
    for name, rows in runs.items():
        steady = rows[1:] or rows
        m = {
            k: statistics.mean(r.get(k, 0.0) for r in steady)
            for k in (
                "time_generation",
                "time_generate",
                "time_score",
                "time_update",
                "time_ci_test_lagged",
                "time_sync",
                "time_step",
            )
        }
        means[name] = m
        lag = max(r["policy_lag_max"] for r in rows)
        diff = max(r["train_rollout_logprob_abs_diff_max"] for r in rows)
        print(
            f"| {name} | {m['time_generation']:.2f} | {m['time_generate']:.2f} | {m['time_score']:.2f} | "
            f"{m['time_update']:.2f} | "
            f"{m['time_ci_test_lagged']:.2f} | {m['time_sync']:.2f} | {m['time_step']:.2f} | {lag} | {diff:.1e} |"
        )
    sync = means["synchronous"]
    for name, m in means.items():
        if name != "synchronous":
            print(
                f"\n{name}: step {m['time_step']:.2f} s vs synchronous {sync['time_step']:.2f} s: "
                f"{sync['time_step'] / m['time_step']:.2f}x (measured, steps 1+)"
            )
    train_phase = sync["time_score"] + sync["time_update"]
    estimate = max(sync["time_generation"], train_phase) + sync["time_sync"]
    print(
        f"separate devices (estimate from the synchronous phases): max(generate {sync['time_generation']:.2f}, score "
        f"+ update {train_phase:.2f}) "
        f"+ sync {sync['time_sync']:.2f} = {estimate:.2f} s per step vs {sync['time_step']:.2f} s synchronous "
        f"({sync['time_step'] / estimate:.2f}x)"
    )


TRL_PRECISIONS = ("fp32", "bf16-autocast")
TRL_LABELS = {
    "fp32": "fp32: bf16=False, its other defaults",
    "bf16-autocast": "its defaults: bf16 autocast over fp32 weights",
}


def trl_steps(
    steps: int, length: int = 64, group: int = 4, fixed_length: bool = False, precision: str = "fp32"
) -> list[float] | None:
    """Seconds of each of ``steps`` GRPOTrainer steps on 4 prompts x ``group`` samples of up to
    ``length`` tokens (``fixed_length``: exactly ``length``, by ``min_new_tokens``); None without TRL.

    ``precision``: ``fp32`` sets ``bf16=False``; ``bf16-autocast`` keeps GRPOConfig's own default (``bf16=True``:
    accelerate runs the forward under CPU autocast to bf16, fp32 weights; on a CPU without bf16 instructions its
    products take ATen's portable GEMM, minutes a step). TRL's other defaults stay, gradient checkpointing
    included."""
    if precision not in TRL_PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {TRL_PRECISIONS}")
    try:
        from datasets import Dataset
        from transformers import TrainerCallback
        from trl import GRPOConfig, GRPOTrainer
    except ImportError as exc:
        print(f"TRL not measured: {exc}")
        return None
    task = ArithmeticTask(seed=1234)
    rows = [{"prompt": task[i].content, "label": task[i].label} for i in range(4 * steps)]

    def reward(completions, label, **_):
        return [
            math_reward("", c[0]["content"] if isinstance(c, list) else c, lab) for c, lab in zip(completions, label)
        ]

    class Clock(TrainerCallback):
        def __init__(self):
            self.times, self.start = [], None

        def on_step_begin(self, *args, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.times.append(time.perf_counter() - self.start)

    clock = Clock()
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        per_device_train_batch_size=4 * group,
        num_generations=group,
        max_completion_length=length,
        temperature=1.0,
        top_p=0.8,
        top_k=32,
        learning_rate=1e-6,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        bf16=precision == "bf16-autocast",
        beta=0.0,
        seed=0,
        dataloader_num_workers=0,
        generation_kwargs={"min_new_tokens": length} if fixed_length else None,
    )
    trainer = GRPOTrainer(
        model=str(smollm2_checkpoint()),
        reward_funcs=reward,
        args=args,
        train_dataset=Dataset.from_list(rows),
        callbacks=[clock],
    )
    trainer.train()
    return clock.times


def trl_in_a_process(steps: int, precision: str = "fp32") -> list[float] | None:
    """``trl_steps`` in a fresh process: nothing of ours (the trainer's allocator setting,
    modeling/host_memory.py; threads; caches) carries over into TRL's run."""
    import json
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, __file__, "--trl-only", "--steps", str(steps), "--trl-precision", precision],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = out.stdout.splitlines()
    line = next((x for x in lines if x.startswith("TRL_TIMES ")), None)
    times = None if line is None else json.loads(line.removeprefix("TRL_TIMES "))
    if times is None:  # say why (no TRL: `pip install trl==1.16.0` beside the CPU torch), never end silently
        print(next((x for x in lines if x.startswith("TRL not measured")), out.stdout[-2000:]))
    return times


def against_trl(run: dict, args) -> None:
    """Ours in fp32, ours in bf16 and TRL's GRPOTrainer (in a process of its own), one after the other for
    ``args.rounds`` rounds (the machine's drift falls on all three; TRL alone varied 15-20 s a step between
    sittings): each run's mean step (steps 1+), then the medians over the rounds and of each round's ratios."""
    rows = []
    slow = slow_bf16(torch.bfloat16, "cpu")
    if slow:  # minutes a step: the bf16 row is a single run (`--dtype bfloat16 --skip-trl`), not a round's
        print(f"bf16 left out of the rounds: {slow}")
    for r in range(args.rounds):
        fp32 = print_steps(f"round {r}: support-replay, float32", ours(**run))["time_step"]
        bf16 = (
            float("nan")
            if slow
            else print_steps(f"round {r}: support-replay, bfloat16", ours(**run, dtype="bfloat16"))["time_step"]
        )
        times = trl_in_a_process(args.steps, args.trl_precision)
        if not times:
            return
        trl = statistics.mean(times[1:] or times)
        print(f"\nround {r}: TRL steps {', '.join(f'{t:.2f}' for t in times)} s")
        rows.append((trl, fp32, bf16))
    print(f"\n| trainer, medians of {args.rounds} alternating rounds | s per GRPO step (steps 1+) | ours faster by |")
    print("|---|---:|---:|")
    median = [statistics.median(row[i] for row in rows) for i in range(3)]
    print(f"| TRL GRPOTrainer {__import__('trl').__version__} ({TRL_LABELS[args.trl_precision]}) | {median[0]:.2f} | |")
    for i, name in [(1, "float32")] + ([] if slow else [(2, "bfloat16 rollout and training")]):
        ratio = statistics.median(row[0] / row[i] for row in rows)
        print(f"| support-replay, {name} (replay + --ci-test) | {median[i]:.2f} | **{ratio:.2f}x** |")
    print("<!-- rounds (TRL, fp32, bf16 s): " + "; ".join(", ".join(f"{x:.2f}" for x in row) for row in rows) + " -->")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--skip-trl", action="store_true")
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument(
        "--true-on-policy", action="store_true", help="batch-invariant engine and trainer, bitwise --ci-test"
    )
    ap.add_argument(
        "--full-vocab-metrics-interval",
        type=int,
        default=1,
        help="the metrics-only full-vocabulary head every N rollouts",
    )
    ap.add_argument(
        "--max-tokens-per-micro-batch", type=int, default=None, help="a token budget instead of --micro-batch-size"
    )
    ap.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="--rollout-dtype and --train-dtype of our run",
    )
    ap.add_argument(
        "--linear-kernel",
        choices=["auto", "torch", "onednn"],
        default="auto",
        help="our --linear-kernel (engine and trainer)",
    )
    ap.add_argument("--packed-scoring", choices=["auto", "on", "off"], default="auto", help="our --packed-scoring")
    ap.add_argument("--with-bf16", action="store_true", help="a bf16 run of ours beside the fp32 one")
    ap.add_argument(
        "--true-on-policy-compare",
        action="store_true",
        help="the normal run, then --true-on-policy-mode, and their ratio",
    )
    ap.add_argument(
        "--async-compare",
        action="store_true",
        help="synchronous vs --async-rollout through serve, engine and trainer on separate cores",
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="ours fp32, ours bf16 and TRL alternating for this many rounds; medians of the rounds",
    )
    ap.add_argument(
        "--trl-precision",
        choices=TRL_PRECISIONS,
        default="fp32",
        help="TRL's run: fp32 (bf16=False) or its own default, bf16 autocast",
    )
    ap.add_argument("--trl-only", action="store_true", help=argparse.SUPPRESS)  # against_trl's subprocess
    args = ap.parse_args()
    if args.trl_only:
        print("TRL_TIMES " + __import__("json").dumps(trl_steps(args.steps, precision=args.trl_precision)))
        return
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU: {cpu_identity()}; {SETTINGS}")
    if args.async_compare:
        print_async_compare(pinned_runs(args.steps))
        return
    run = dict(
        steps=args.steps,
        micro_batch=args.micro_batch_size,
        full_vocab_metrics_interval=args.full_vocab_metrics_interval,
        max_tokens=args.max_tokens_per_micro_batch,
        packed=args.packed_scoring,
        linear_kernel=args.linear_kernel,
    )
    if args.true_on_policy_compare:
        normal = print_steps("normal (fp32)", ours(**run))
        exact = print_steps(
            "true-on-policy (batch-invariant engine and trainer, --ci-test at tolerance 0)",
            ours(**run, true_on_policy=True),
        )
        print("\n| phase (mean of steps 1+) | normal s | true-on-policy s | ratio |")
        print("|---|---:|---:|---:|")
        for k in ("time_generate", "time_update", "time_step"):
            print(f"| {k.removeprefix('time_')} | {normal[k]:.2f} | {exact[k]:.2f} | {exact[k] / normal[k]:.2f}x |")
        return
    if args.rounds:
        against_trl(run, args)
        return
    mean = print_steps(
        f"support-replay, {args.dtype}, packed scoring {args.packed_scoring}",
        ours(**run, true_on_policy=args.true_on_policy, dtype=args.dtype),
    )
    bf16 = (
        print_steps("support-replay, bfloat16 rollout and training", ours(**run, dtype="bfloat16"))
        if args.with_bf16
        else None
    )
    if not args.skip_trl:
        times = trl_steps(args.steps, precision=args.trl_precision)
        if times:
            trl_mean = statistics.mean(times[1:] or times)
            print(f"\nTRL steps: {', '.join(f'{t:.2f}' for t in times)} s")
            print("\n| trainer | s per GRPO step (steps 1+) | ours faster by |")
            print("|---|---:|---:|")
            print(
                f"| TRL GRPOTrainer {__import__('trl').__version__} ({TRL_LABELS[args.trl_precision]}) "
                f"| {trl_mean:.2f} | |"
            )
            print(
                f"| support-replay, {args.dtype} (replay + --ci-test) | {mean['time_step']:.2f} | "
                f"{trl_mean / mean['time_step']:.2f}x |"
            )
            if bf16:
                print(
                    f"| support-replay, bfloat16 (replay + --ci-test) | {bf16['time_step']:.2f} | "
                    f"{trl_mean / bf16['time_step']:.2f}x |"
                )


if __name__ == "__main__":
    main()
