"""The GRPO recipe with sampling-support replay: rollout, validate, score, update, sync, log.

Under replay the actor's policy ratio is computed on the support S_t the engine captured
(SPEC section 1); the full-vocabulary score rides along for KL and metrics.
"""

from __future__ import annotations

import time
from pathlib import Path

from ..config import RunConfig
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .dist import close_distributed, init_distributed
from .metrics import MetricsLog
from .trainer import CITestError, Trainer
from .weights import WeightSync

__all__ = ["CITestError", "train"]


def train(cfg: RunConfig) -> list[dict]:
    """Run ``cfg`` to the end; returns the metrics rows (rank 0)."""
    ctx = init_distributed()
    try:
        return _run(cfg, ctx)
    finally:
        close_distributed(ctx)


def _run(cfg: RunConfig, ctx) -> list[dict]:
    trainer = Trainer(cfg, ctx)
    out = Path(cfg.output_dir)
    if ctx.is_main:
        cfg.save_effective(out)
    sync = WeightSync(engine=trainer.engine, url=cfg.rollout_url, staging=out / "weights") if ctx.is_main else None

    start = 0
    if cfg.resume and (ckpt := latest_checkpoint(Path(cfg.save))) is not None:
        start = load_checkpoint(ckpt, trainer.actor)["rollout"]
        push(sync, trainer, ctx)  # the engine samples with the restored weights
    log = MetricsLog(out, cfg.num_rollout, start, progress=cfg.progress, enabled=ctx.is_main)

    for r in range(start, cfg.num_rollout):
        t0, timings = time.perf_counter(), {}
        samples = trainer.timed("generate", timings, trainer.rollout, r)  # validated (SPEC section 3)
        scores = trainer.timed("score", timings, trainer.score_old, samples)  # fused into the update when it can be
        advantages, adv_stats = trainer.advantages(samples, scores)
        # --ci-test raises on any mismatch, before the optimizer takes its first step
        check = {}
        update = trainer.timed("update", timings, trainer.update, samples, scores, advantages, lambda old: check.update(trainer.ci_check(r, samples, old)))
        trainer.timed("sync", timings, push, sync, trainer, ctx)
        row = {"rollout": r, **trainer.rollout_metrics(samples, scores), **check, **adv_stats, **update, **timings}
        if cfg.eval_interval and (r + 1) % cfg.eval_interval == 0:
            row.update(trainer.evaluate(r))
        if cfg.save and cfg.save_interval and (r + 1) % cfg.save_interval == 0:
            save_checkpoint(Path(cfg.save), r + 1, trainer.actor, ctx, {"metrics": row})
        row["time_step"] = time.perf_counter() - t0
        log.log(row)

    log.close()
    if trainer.engine is not None:
        trainer.engine.shutdown()
    return log.rows


def push(sync: WeightSync | None, trainer: Trainer, ctx) -> None:
    """Gather the unsharded weights (every rank) and hand them to the engine (rank 0)."""
    state = trainer.actor.full_state_dict()
    if ctx.is_main and sync is not None:
        sync.push(state)
