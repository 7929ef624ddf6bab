"""The GRPO recipe with sampling-support replay, top to bottom (docs/training.md lists its steps).

Under replay the policy ratio is computed on the support S_t the engine captured
(docs/math.md); the full-vocabulary score rides along for KL and metrics. Each step is one call
into the component that owns it: lag, drift and --ci-test under a lag live in ``checks``, the
fused path (the update's forward as the old policy's) in ``Learner.update``.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoTokenizer

from ..backends.kind import WeightRoute
from ..modeling.checkpoints import smollm2_checkpoint
from ..modeling.host_memory import keep_freed_memory
from ..modeling.linear_kernels import slow_bf16
from .checkpoint import latest_checkpoint, load_checkpoint, save_if_due, saved_rollout
from .checks import RolloutChecks, check_policy_lag
from .config import RunConfig
from .dist import close_distributed, init_distributed, on_main
from .lagged import lagged_scorer
from .learner import Learner
from .metrics import MetricsLog, Timings, rollout_metrics
from .producer import RolloutProducer
from .rollouts import Rollouts
from .trackers import Trackers
from .versions import PolicyVersions, policy_version

__all__ = ["policy_version", "train"]


def train(cfg: RunConfig, as_given: RunConfig | None = None) -> list[dict]:
    """Run ``cfg`` to the end; returns the metrics rows (rank 0). ``as_given``: the config to write and log
    when ``cfg`` is it running through the engines it started (``--rollout-num-gpus-per-engine``)."""
    keep_freed_memory()  # a step's large tensors reuse the last step's memory (modeling/host_memory.py)
    ctx = init_distributed()
    try:
        with deterministic_mode(cfg.replay.deterministic_mode):
            return _run(cfg, ctx, as_given or cfg)
    finally:
        close_distributed(ctx)


@contextmanager
def deterministic_mode(on: bool):
    """``--deterministic-mode``: torch's deterministic algorithms within (an op without one fails)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(before or on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before)


def _run(cfg: RunConfig, ctx, as_given: RunConfig) -> list[dict]:
    learner, rollouts, versions, checks, start = _set_up(cfg, ctx, as_given)
    trackers = Trackers(cfg.output, as_given.flat(), enabled=ctx.is_main, start=start)
    log = MetricsLog(
        Path(cfg.output.output_dir),
        cfg.rollout.num_rollout,
        start,
        progress=cfg.output.progress,
        enabled=ctx.is_main,
        trackers=trackers,
    )
    # a rollout in flight at a crash is generated again on resume
    producer = RolloutProducer(rollouts, cfg.production, cfg.rollout.num_rollout, ctx)
    try:
        producer.start(start)
        for r in range(start, cfg.rollout.num_rollout):
            clock = Timings()
            with clock("generate"):  # 1. generate (--async-rollout: generated during the last update)
                samples, failures = producer.take(r, versions.pushed)
            producer.start(r + 1)  # --async-rollout: on the current weights, while this rollout trains
            if not samples:  # every group dropped: nothing to learn from, nothing to push
                log.log({"rollout": r, "skipped": True, **failures, **clock.total()})
                continue
            lag, ages = check_policy_lag(
                r, samples, versions.pushed, cfg.production.max_policy_lag, rollouts.engine_name
            )
            steps = learner.plan(samples, r, rollouts.penalty_semantics)  # 2. plan
            with clock("score"):  # 3. score (unless fused), and the reference
                old = learner.score_before_update(steps, len(samples), samples)
            checked, trained = checks(r, samples, old, ages, clock)  # 4. check (--ci-test), support drift
            if trained is not samples:  # stale samples that lost the policy's mass left the loss
                steps = learner.plan(trained, r, rollouts.penalty_semantics)
            advantages, adv_stats = learner.advantages(samples, old)  # 5. advantages
            with clock("update"):  # 6. update
                update, fused_old = learner.update(r, steps, trained, old, advantages, len(samples))
            if old.logp is None:  # fused: checked on the update's own forward, never gated
                old = fused_old
                checked, _ = checks(r, samples, old, ages, clock, gate=False)
            with clock("sync"):  # 7. sync
                versions.advance(learner, ctx, r + 1)
            measured = rollout_metrics(samples, old.logp, old.full, learner.replay)  # 8. metrics
            measured.update(learner.routing_metrics())
            measured.update(learner.teacher_metrics())
            row = {"rollout": r, **measured, **failures, **lag, **checked, **adv_stats, **update.row(), **clock}
            row.update(rollouts.evaluate_if_due(r))
            save_if_due(cfg.output.save, cfg.output.save_interval, r, learner.actor, ctx, row)  # 9. save
            log.log({**row, **clock.total()})
    finally:
        producer.close()
        log.close()
        rollouts.close()
    return log.rows


def _set_up(cfg: RunConfig, ctx, as_given: RunConfig):
    """The learner, the rollout side, the versions and the checks, resumed from the latest checkpoint."""
    checkpoint = Path(cfg.data.hf_checkpoint) if cfg.data.hf_checkpoint else on_main(smollm2_checkpoint, ctx)
    learner = Learner.from_config(cfg, ctx, checkpoint)
    found = latest_checkpoint(Path(cfg.output.save)) if cfg.output.resume else None
    start = saved_rollout(found) if found is not None else 0
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    rollouts = Rollouts.from_config(
        cfg, ctx, checkpoint, tokenizer, learner.vocab_size, policy_version(start), learner.routing_shape
    )
    if found is not None:
        load_checkpoint(found, learner.actor)
    out = Path(cfg.output.output_dir)
    if ctx.is_main:
        as_given.save_effective(out)  # --config reads it back: the launch flags, not the address they gave
    sync = None
    if ctx.is_main:
        lora = cfg.optimizer.lora if cfg.engine.lora_sync == "adapter" else None
        route = WeightRoute(out / "weights", cfg.engine.weight_sync_mode, cfg.engine.weight_transport, lora)
        sync = rollouts.kind.weight_sync(route)
    keeps = bool(cfg.replay.ci_test and cfg.production.max_policy_lag)
    lagged = lagged_scorer(
        learner, ctx, checkpoint, max_policy_lag=cfg.production.max_policy_lag, ci_test=cfg.replay.ci_test
    )
    versions = PolicyVersions(start, sync, lagged, keeps)
    remote = rollouts.kind.remote
    if remote or start or keeps:  # an engine of its own, or a resume: it samples exactly these weights
        versions.push(learner, ctx, to_engine=remote or bool(start))
    checks = RolloutChecks(
        ctx,
        replay=learner.replay,
        ci_test=cfg.replay.ci_test,
        tolerance=cfg.replay.ci_tolerance,
        min_support_mass=cfg.replay.min_support_mass,
        versions=versions,
        semantics=rollouts.penalty_semantics,
        stale_kv=cfg.engine.weight_sync_mode == "in_place",
    )
    slow = slow_bf16(getattr(torch, cfg.replay.train_dtype), ctx.device)
    if ctx.is_main and slow:
        print(f"warning: train_dtype bfloat16: {slow}", flush=True)
    if ctx.is_main and cfg.replay.ci_test:
        print(
            f"--ci-test: every token within {cfg.replay.ci_tolerance:g} of its log mu "
            f"(rollout {cfg.replay.rollout_dtype}, trainer {cfg.replay.train_dtype})",
            flush=True,
        )
    return learner, rollouts, versions, checks, start
