"""Agent rollouts: ``n`` episodes per task, played concurrently, grouped task by task.

The counterpart of ``generate.generate_samples`` for agents, with the same failure rule: an
episode that did not end cleanly (its engine failed, the agent raised or ran out of time)
never trains; its whole GRPO group is played again with fresh seeds, or dropped.
"""

from __future__ import annotations

import asyncio

from ..errors import ConfigError, EngineUnavailable
from .agents import AgentRunner, Episode
from .generate import FAILED_GROUP_POLICIES, RolloutStats, request_seed
from .sample import Sample
from .session import SessionSettings


def generate_episodes(
    runner: AgentRunner,
    tasks: list,
    *,
    n_samples: int,
    settings: SessionSettings,
    rollout: int,
    seed: int,
    failed_group_policy: str = "regenerate",
    max_regenerations: int = 2,
) -> tuple[list[Sample], RolloutStats]:
    """Samples of every episode, group by group, indices in order; an episode split by a history
    rewrite gives several samples sharing ``metadata["episode"]`` (and its reward)."""
    if failed_group_policy not in FAILED_GROUP_POLICIES:
        raise ConfigError(f"failed_group_policy: one of {FAILED_GROUP_POLICIES}, got {failed_group_policy!r}")
    stats = RolloutStats()
    retries_before = runner.store.backend.retries
    answered: dict[int, list] = {}
    pending, attempt = list(range(len(tasks))), 0
    while pending:
        episodes = [Episode(g * n_samples + j, g, tasks[g].content, tasks[g].label, max_turns=settings.max_turns)
                    for g in pending for j in range(n_samples)]
        seeds = [request_seed(seed, rollout, ep.index, attempt) for ep in episodes]
        results = asyncio.run(_play_all(runner, episodes, seeds, settings, rollout))
        failed = []
        for i, g in enumerate(pending):
            group = results[i * n_samples : (i + 1) * n_samples]
            errors = [r.error for r in group if r.error is not None]
            stats.failed_samples += len(errors)
            if errors:
                failed.append((g, errors[0]))
            else:
                answered[g] = group
        if not failed:
            break
        if failed_group_policy == "drop":
            stats.dropped_groups += len(failed)
            break
        if attempt >= max_regenerations:
            g, error = failed[0]
            raise EngineUnavailable(f"rollout {rollout}, group {g}: no complete episode after {attempt + 1} attempts ({type(error).__name__}: {error})")
        stats.regenerated_groups += len(failed)
        pending, attempt = [g for g, _ in failed], attempt + 1
    stats.retries = runner.store.backend.retries - retries_before
    samples: list[Sample] = []
    episode = 0
    for position, g in enumerate(sorted(answered)):
        for result in answered[g]:
            for s in result.samples:
                s.index, s.group = len(samples), position
                s.metadata["episode"] = episode
                samples.append(s)
            episode += 1
    return samples, stats


async def _play_all(runner: AgentRunner, episodes: list[Episode], seeds: list[int], settings: SessionSettings, rollout: int):
    return await asyncio.gather(*(runner.episode(ep, seed=s, settings=settings, rollout=rollout) for ep, s in zip(episodes, seeds)))
