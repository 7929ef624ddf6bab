"""Where the trainer's rollouts come from, and how old their tokens may be.

Synchronous (the default), rollout ``r`` is generated when the trainer asks for it, on the
weights it just pushed. With ``--async-rollout``, rank 0 generates rollout ``r + 1`` on a
background thread while the ranks train on rollout ``r``; the weights pushed after that update
reach the engine between requests (``--weight-sync-mode``), so the tokens of rollout ``r + 1``
were sampled one push before the trainer scores them: a policy lag of 1.

A sample is as old as its oldest token (every token carries the weight version that sampled
it). A group with a sample older than ``--max-policy-lag`` pushes is handled by
``--stale-sample-policy``: ``fail`` leaves it to ``checks.check_policy_lag``, which stops the
run; ``drop`` removes the group; ``regenerate`` generates it again on the current weights.
Either way it never trains, and the metrics count it. Rank 0 does all of this and then
broadcasts the rollout, so every rank trains on the same samples.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

from ..errors import PolicyLagError
from ..rollout.sample import Sample
from .checks import mask_beyond_lag, sample_age, version_ages
from .dist import on_main
from .sections import ProductionConfig


def renumbered(samples: list[Sample]) -> list[Sample]:
    """Indices 0.., groups and agent episodes numbered in order: what the plan and the advantages
    expect after groups were dropped or replaced. A rollout has one group per prompt, and a
    prompt's samples all come from one generation, so the prompt names the group."""
    groups: dict = {}
    episodes: dict = {}
    out = []
    for i, s in enumerate(samples):
        meta = dict(s.metadata)
        group = groups.setdefault(meta.get("prompt", s.group), len(groups))
        if "episode" in meta:
            meta["episode"] = episodes.setdefault((group, meta["episode"]), len(episodes))
        out.append(replace(s, index=i, group=group, metadata=meta))
    return out


class RolloutProducer:
    def __init__(self, rollouts, production: ProductionConfig, num_rollout: int, ctx):
        self.rollouts, self.production_cfg, self.num_rollout, self.ctx = rollouts, production, num_rollout, ctx
        self.pool = (
            ThreadPoolExecutor(1, thread_name_prefix="rollout")
            if self.production_cfg.async_rollout and ctx.is_main
            else None
        )
        self.pending: dict[int, Future] = {}

    def start(self, r: int) -> None:
        """Rank 0 begins rollout ``r`` in the background (``--async-rollout``); otherwise nothing
        happens until ``take``."""
        if self.pool is not None and r < self.num_rollout and r not in self.pending:
            self.pending[r] = self.pool.submit(self._generate, r)

    def take(self, r: int, pushed: list[str]) -> tuple[list[Sample], dict]:
        """Rollout ``r`` on every rank, stale groups handled: ``(samples, what failed or was old)``.
        ``pushed``: the weight versions in push order, the current one last."""

        def on_rank_0():
            future = self.pending.pop(r, None)
            samples, stats = future.result() if future is not None else self._generate(r, pushed)
            result = self._fresh(r, samples, stats, pushed)
            if self.pool is None:  # synchronous: nothing generates until the update's weights are pushed
                self.rollouts.release_engine_memory()
            return result

        return on_main(on_rank_0, self.ctx)  # a failure on rank 0 stops every rank

    def close(self) -> None:
        if self.pool is not None:
            for future in self.pending.values():
                future.cancel()
            self.pool.shutdown(wait=True, cancel_futures=True)

    def _generate(self, r: int, pushed: list[str] | None = None) -> tuple[list[Sample], dict]:
        t0 = time.perf_counter()
        samples, stats = self.rollouts.produce(r, pushed)
        return samples, {**stats, "time_generation": time.perf_counter() - t0}

    def _fresh(self, r: int, samples: list[Sample], stats: dict, pushed: list[str]) -> tuple[list[Sample], dict]:
        stats = {**stats, "stale_samples": 0, "stale_groups_dropped": 0, "stale_groups_regenerated": 0}
        if self.production_cfg.partial_rollout:  # kept tokens too old are masked, not generated again
            samples, masked = mask_beyond_lag(samples, version_ages(pushed), self.production_cfg.max_policy_lag)
            samples, stats = self.rollouts.whole_batches(renumbered(samples), {**stats, **masked})
        if self.production_cfg.stale_sample_policy == "fail":  # check_policy_lag names the first one and stops the run
            return samples, stats
        ages = version_ages(pushed)
        for round_ in range(self.production_cfg.max_regenerations + 1):
            stale = [s for s in samples if (sample_age(s, ages) or 0) > self.production_cfg.max_policy_lag]
            if not stale:
                return samples, stats
            prompts = sorted({s.metadata["prompt"] for s in stale})
            stats["stale_samples"] += len(stale)
            kept = [s for s in samples if s.metadata["prompt"] not in prompts]
            if self.production_cfg.stale_sample_policy == "drop":
                stats["stale_groups_dropped"] += len(prompts)
                return self.rollouts.whole_batches(renumbered(kept), stats)
            if round_ == self.production_cfg.max_regenerations:
                break
            again, more = self.rollouts.regenerate(r, prompts, round_ + 1)
            stats["stale_groups_regenerated"] += len(prompts)
            for key in ("failed_samples", "regenerated_groups", "dropped_groups", "retries"):
                stats[key] = stats.get(key, 0) + more.get(key, 0)
            # a group the engine failed to answer again may be dropped (--failed-group-policy): whole batches only
            samples, stats = self.rollouts.whole_batches(
                renumbered(sorted(kept + again, key=lambda s: s.metadata["prompt"])), stats
            )
        worst = stale[0]
        raise PolicyLagError(
            f"rollout {r}, prompt {worst.metadata['prompt']}: still sampled by weights "
            f"{[v.version for v in worst.weight_versions]} "
            f"after {self.production_cfg.max_regenerations} regenerations, but the trainer pushed {pushed[-1]!r} last "
            "and --max-policy-lag="
            f"{self.production_cfg.max_policy_lag}: the engine does not load the weights it is sent"
        )
