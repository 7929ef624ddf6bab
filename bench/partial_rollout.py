"""Long-tailed responses: trained tokens per second and engine idle share for synchronous rollouts, async lag 1,
partial rollouts and in-flight updates, in one sitting, and the tokens each generated and threw away.

    python bench/partial_rollout.py [--rollouts 4] [--max-len 256] [--modes sync,async,partial,in-flight]
                                    [--trace runs.json]

GRPO on SmolLM2-135M-Instruct (the in-process engine, colocated: engine and trainer share the 2 cores), the
built-in arithmetic task (4 prompts x 4 samples a rollout, temperature 1, top_p 0.8, top_k 32, EOS ends a
response: SmolLM2's answers run from a few tokens to the cap, the printed lengths show the spread), --ci-test on.

- ``sync``: generate, then update, then push (``--weight-sync-mode wait``).
- ``async``: ``--async-rollout --max-policy-lag 1``: the next rollout generates during the update; its push waits
  for the requests in flight.
- ``partial``: ``--partial-rollout --over-sampling-batch-size 8 --max-policy-lag 1``: 8 groups sent, the first 4
  to finish train, the rest are stopped and continued after the push.
- ``in-flight``: ``--async-rollout --max-policy-lag 1 --weight-sync-mode retract``: the push lands between decode
  steps, the running requests recomputed under the new weights and continued.

Trained tokens: response tokens that trained (loss mask 1), over the wall time of the run (the first rollout
included: every mode pays it). Engine idle share: the share of the run's wall time in which the engine ran no
prefill or decode step. Masked: tokens older than --max-policy-lag when their group trained (the context of later
tokens, never trained). Thrown away: tokens generated that neither trained, nor were masked, nor are kept for a
later rollout (a kept group too old to train is dropped whole).

``--trace`` writes each run's engine steps (start, duration, batch rows or prefilled tokens) and trainer calls
(scoring, update, the checks), its requests' prompt
and response lengths in the order they ended, and its per-rollout timings: the inputs and the targets of
bench/fleet_sim.py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from support_replay.engine import Engine
from support_replay.modeling.checkpoints import smollm2_checkpoint
from support_replay.modeling.kernel_probe import cpu_identity
from support_replay.train import train
from support_replay.train.checks import RolloutChecks
from support_replay.train.config import RunConfig
from support_replay.train.learner import Learner

MODES = {
    "sync": {},
    "async": dict(async_rollout=True, max_policy_lag=1),
    "partial": dict(partial_rollout=True, over_sampling_batch_size=8, max_policy_lag=1),
    "in-flight": dict(async_rollout=True, max_policy_lag=1, weight_sync_mode="retract"),
}


class EngineClock:
    """The time the run's in-process engine spends in prefills and decode steps, and the engine itself."""

    def __init__(self):
        self.busy, self.engine = 0.0, None
        self.lengths: list[int] = []  # of the responses that ended by themselves (EOS or the cap), not stopped
        self.requests: list[tuple[int, int]] = []  # (prompt, response) tokens of those, in the order they ended
        self.steps: list[tuple[str, float, float, int]] = []  # (kind, start, seconds, rows or prefilled tokens)
        self.t0 = time.perf_counter()
        self._patched = []

    def __enter__(self):
        clock = self
        finish = Engine._finish_ok

        def finished(engine, request, future, completion):
            if completion.finish_reason.get("type") != "abort":
                clock.lengths.append(len(request.input_ids) + completion.num_tokens)
                clock.requests.append((len(request.input_ids), completion.num_tokens))
            return finish(engine, request, future, completion)

        Engine._finish_ok = finished
        self._patched.append((Engine, "_finish_ok", finish))
        for name in ("_decode", "_prefill_and_join"):
            original = getattr(Engine, name)

            def timed(engine, *args, _original=original, _name=name, **kw):
                clock.engine = engine
                if _name == "_decode":
                    size = len(engine.batch.rows)
                else:
                    size = sum(len(s.fed_ids()) for s in args[0])
                t0 = time.perf_counter()
                try:
                    return _original(engine, *args, **kw)
                finally:
                    took = time.perf_counter() - t0
                    clock.busy += took
                    clock.steps.append((_name.strip("_"), t0 - clock.t0, took, size))

            setattr(Engine, name, timed)
            self._patched.append((Engine, name, original))
        trainer = [(Learner, "score_before_update"), (Learner, "update"), (RolloutChecks, "__call__")]
        for owner, name in trainer:  # the trainer's work: the colocation slowdown, the lagged check's cost
            original = getattr(owner, name)

            def trained(learner, *args, _original=original, _name=name, **kw):
                t0 = time.perf_counter()
                try:
                    return _original(learner, *args, **kw)
                finally:
                    kind = "checks" if _name == "__call__" else _name
                    clock.steps.append((kind, t0 - clock.t0, time.perf_counter() - t0, 0))

            setattr(owner, name, trained)
            self._patched.append((owner, name, original))
        return self

    def __exit__(self, *exc):
        for owner, name, original in self._patched:
            setattr(owner, name, original)


def run(mode: str, rollouts: int, max_len: int) -> dict:
    cfg = RunConfig(
        hf_checkpoint=str(smollm2_checkpoint()),
        task_max_operand=20,
        rollout_batch_size=4,
        n_samples_per_prompt=4,
        global_batch_size=16,
        rollout_max_response_len=max_len,
        rollout_temperature=1.0,
        rollout_top_p=0.8,
        rollout_top_k=32,
        num_rollout=rollouts,
        lr=1e-6,
        ci_test=True,
        progress=False,
        output_dir=tempfile.mkdtemp(prefix="bench-partial-"),
        **MODES[mode],
    )
    with EngineClock() as clock:
        every = train(cfg)
        wall = time.perf_counter() - clock.t0
    rows = [r for r in every if not r.get("skipped")]  # a rollout whose every group was dropped trained nothing
    masked = sum(r.get("lag_masked_tokens", 0) for r in rows)  # older than the lag: context, never trained
    trained = sum(r["response_len_mean"] * r["samples"] for r in rows) - masked
    generated = clock.engine.stats.generated_tokens
    kept = every[-1].get("kept_tokens", 0)
    return {
        "mode": mode,
        "wall": wall,
        "trained": trained,
        "rate": trained / wall,
        "idle": 1 - clock.busy / wall,
        "generated": generated,
        "masked": masked,
        "thrown": generated - trained - kept - masked,
        "kept": kept,
        "lag": max(r["policy_lag_max"] for r in rows),
        "diff": max(r["train_rollout_logprob_abs_diff_max"] for r in rows),
        "straddling": sum(r["straddling_samples"] for r in rows),
        "skipped": len(every) - len(rows),
        "lengths": clock.lengths,
        "trace": {
            "wall": wall,
            "steps": clock.steps,
            "requests": clock.requests,
            "samples_per_rollout": cfg.rollout.rollout_batch_size * cfg.rollout.n_samples_per_prompt,
            "rollouts": [
                {k: r[k] for k in ("time_step", "time_generate", "time_sync", "samples", "response_len_mean")}
                for r in rows
            ],
            "trained": trained,
            "busy": clock.busy,
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rollouts", type=int, default=4)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--trace", help="write each run's engine steps, requests and timings to this JSON file")
    args = ap.parse_args()
    traces = {}
    print(f"CPU: {cpu_identity()}, {torch.get_num_threads()} threads; SmolLM2-135M-Instruct fp32, in process")
    print(f"{args.rollouts} rollouts of 4 prompts x 4 samples, up to {args.max_len} tokens, EOS ends a response\n")
    print(
        "| mode | wall s | trained tokens | trained tokens/s | engine idle | generated | masked (lag) | thrown away "
        "| kept at end | straddling samples | max lag | max abs diff (ci-test) |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode in args.modes.split(","):
        m = run(mode, args.rollouts, args.max_len)
        print(
            f"| {mode} | {m['wall']:.1f} | {m['trained']:.0f} | {m['rate']:.1f} | {m['idle']:.0%} | {m['generated']} "
            f"| {m['masked']} | {m['thrown']:.0f} | {m['kept']} | {m['straddling']} | {m['lag']} | {m['diff']:.1e} |",
            flush=True,
        )
        lengths = sorted(m["lengths"])
        print(
            f"<!-- {mode}: {len(lengths)} requests ended by themselves; prompt + response length min {lengths[0]}, "
            f"median {statistics.median(lengths):.0f}, max {lengths[-1]}; {m['skipped']} rollouts skipped -->",
            flush=True,
        )
        traces[mode] = {"cpu": cpu_identity(), "max_len": args.max_len, **m["trace"]}
        if args.trace:
            with open(args.trace, "w") as f:
                json.dump(traces, f)


if __name__ == "__main__":
    main()
