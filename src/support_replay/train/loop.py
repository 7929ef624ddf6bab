"""The GRPO recipe with sampling-support replay, top to bottom.

rollout (with --async-rollout, generated during the previous update) -> policy lag -> plan
micro-batches -> score before the update -> --ci-test (under the weights that sampled each
token) -> support drift -> advantages -> loss, backward, optimizer step (per global batch) ->
weights to the engine -> metrics.

Under replay the policy ratio is computed on the support S_t the engine captured
(docs/math.md); the full-vocabulary score rides along for KL and metrics.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from transformers import AutoTokenizer

from ..modeling.checkpoints import smollm2_checkpoint
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, saved_rollout
from .checks import check_policy_lag, compare_with_rollout
from .config import RunConfig
from .dist import close_distributed, init_distributed, on_main
from .drift import support_drift
from .lagged import LaggedScorer
from .learner import Learner, UpdateMetrics
from .metrics import MetricsLog, rollout_metrics
from .producer import RolloutProducer
from .rollouts import Rollouts
from .weights import make_weight_sync


def policy_version(updates: int) -> str:
    """The name the trainer gives the weights after ``updates`` rollouts' updates."""
    return str(updates)


def train(cfg: RunConfig) -> list[dict]:
    """Run ``cfg`` to the end; returns the metrics rows (rank 0)."""
    ctx = init_distributed()
    try:
        return _run(cfg, ctx)
    finally:
        close_distributed(ctx)


class Timings(dict):
    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[f"time_{name}"] = time.perf_counter() - start


def _run(cfg: RunConfig, ctx) -> list[dict]:
    checkpoint = Path(cfg.hf_checkpoint) if cfg.hf_checkpoint else on_main(smollm2_checkpoint, ctx)
    learner = Learner(cfg, ctx, checkpoint)
    found = latest_checkpoint(Path(cfg.save)) if cfg.resume else None
    start = saved_rollout(found) if found is not None else 0
    pushed = [policy_version(start)]  # weight versions in push order, the engine's current one last
    rollouts = Rollouts(cfg, ctx, checkpoint, AutoTokenizer.from_pretrained(checkpoint), learner.vocab_size, pushed[-1])
    if found is not None:
        load_checkpoint(found, learner.actor)
    out = Path(cfg.output_dir)
    if ctx.is_main:
        cfg.save_effective(out)
    sync = (
        make_weight_sync(
            engine=rollouts.engine,
            url=cfg.rollout_url,
            rollout_engine=cfg.rollout_engine,
            staging=out / "weights",
            mode=cfg.weight_sync_mode,
            transport=cfg.weight_transport,
        )
        if ctx.is_main
        else None
    )
    # --ci-test under a lag scores older tokens under the weights that sampled them, kept on rank 0
    keeps_versions = bool(cfg.ci_test and cfg.max_policy_lag)
    lagged = (
        LaggedScorer(
            checkpoint,
            ctx.device,
            keep=cfg.max_policy_lag + 1,
            sparse=learner.actor.sparse_head,
            batch_invariant=cfg.true_on_policy_mode,
            compute_dtype=learner.actor.model.compute_dtype,
            temperature=cfg.rollout_temperature,
            micro_batch=cfg.micro_batch,
            max_tokens=cfg.max_tokens_per_micro_batch,
            pack=learner.pack,
            linear_kernel=learner.linear_kernel,
        )
        if ctx.is_main and keeps_versions
        else None
    )
    if (
        cfg.rollout_url or start or keeps_versions
    ):  # an engine of its own, or a resume: it samples with exactly these weights, so named
        push(sync if (cfg.rollout_url or start) else None, learner, ctx, pushed[-1], lagged)
    log = MetricsLog(out, cfg.num_rollout, start, progress=cfg.progress, enabled=ctx.is_main)
    tolerance = cfg.ci_tolerance
    if ctx.is_main and cfg.ci_test:
        print(
            f"--ci-test: every token within {tolerance:g} of its log mu (rollout {cfg.rollout_dtype}, trainer {cfg.train_dtype})",
            flush=True,
        )
    producer = RolloutProducer(rollouts, cfg, ctx)  # a rollout in flight at a crash is generated again on resume
    try:
        producer.start(start)
        for r in range(start, cfg.num_rollout):
            t0, clock = time.perf_counter(), Timings()
            with clock("generate"):  # with --async-rollout: the wait for a rollout generated during the last update
                samples, failures = producer.take(r, pushed)  # every completion validated once, where it entered
            producer.start(r + 1)  # --async-rollout: on the current weights, while this rollout trains
            if not samples:  # every group dropped: nothing to learn from, nothing to push
                log.log({"rollout": r, "skipped": True, **failures, **clock, "time_step": time.perf_counter() - t0})
                continue
            lag, ages = check_policy_lag(r, samples, pushed, cfg.max_policy_lag, rollouts.engine_name)
            steps = learner.plan(
                samples, r, rollouts.penalty_semantics
            )  # micro-batches for every pass, planned once, on the device
            with clock("score"):
                old = learner.score_before_update(steps, len(samples))  # old log-probs (unless fused), reference

            def ci_check(logp: list) -> dict:  # per token against log mu, under the weights that sampled it
                if not learner.replay:  # without replay there is no log mu to compare with
                    return {}
                if keeps_versions:
                    with clock("ci_test_lagged"):  # the extra forward of older tokens under their own weights
                        logp = on_main(
                            lambda: (
                                lagged.by_sampling_version(samples, logp, pushed[-1], rollouts.penalty_semantics)
                                if lagged
                                else None
                            ),
                            ctx,
                        )
                return compare_with_rollout(r, samples, logp, tolerance=tolerance, fail=cfg.ci_test)

            check = ci_check(old.logp) if old.logp is not None else {}
            drift, trained = support_drift(samples, old.logp, old.full, ages, learner.replay, cfg.min_support_mass)
            if trained is not samples:  # stale samples whose supports lost the policy's mass left the loss
                steps = learner.plan(trained, r, rollouts.penalty_semantics)  # same batches, new loss normalisers
            advantages, adv_stats = learner.advantages(samples, old)
            with clock("update"):
                per_step = []
                for step in steps:
                    result = learner.backward(
                        r, step, trained, old, advantages
                    )  # loss weighted by losses.token_weights
                    if old.logp is None:  # fused: that forward ran before any step, so it scored the old policy
                        old = learner.with_fresh_old(old, result.scores, len(samples))
                        check = ci_check(old.logp)
                        drift, _ = support_drift(
                            samples, old.logp, old.full, ages, learner.replay
                        )  # no gate: it is never fused
                    per_step.append(
                        (result.sums, learner.optimizer_step(r))
                    )  # stops on a NaN gradient, before the step
            update = UpdateMetrics.mean(per_step)
            with clock("sync"):
                pushed.append(policy_version(r + 1))
                push(sync, learner, ctx, pushed[-1], lagged)
            row = {
                "rollout": r,
                **rollout_metrics(samples, old.logp, old.full, learner.replay),
                **failures,
                **lag,
                **check,
                **drift,
                **adv_stats,
                **asdict(update),
                **clock,
            }
            if cfg.eval_interval and (r + 1) % cfg.eval_interval == 0:
                row.update(rollouts.evaluate(r))
            if cfg.save and cfg.save_interval and (r + 1) % cfg.save_interval == 0:
                save_checkpoint(Path(cfg.save), r + 1, learner.actor, ctx, {"metrics": row})
            row["time_step"] = time.perf_counter() - t0
            log.log(row)
    finally:
        producer.close()
        log.close()
        rollouts.close()
    return log.rows


def push(sync, learner: Learner, ctx, version: str, lagged: LaggedScorer | None = None) -> None:
    """Gather the unsharded weights (every rank) and hand them to the engine as ``version`` (rank 0,
    when there is a ``sync``); ``lagged`` keeps a copy for --ci-test under a policy lag."""
    state = learner.actor.full_state_dict()
    if ctx.is_main and sync is not None:
        sync.push(state, version)
    if lagged is not None:
        lagged.add(version, state)
