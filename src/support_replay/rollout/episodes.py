"""Agent rollouts: ``n`` episodes per task, played concurrently, grouped task by task.

The counterpart of ``generate.generate_samples`` for agents, with the same failure rule: an
episode that did not end cleanly (its engine failed, the agent raised or ran out of time)
never trains; its whole GRPO group is played again with fresh seeds, or dropped.
"""

from __future__ import annotations

import asyncio

from .agents import AgentRunner, Episode
from .generate import RolloutStats, complete_groups, request_seed
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
    retries_before = runner.store.backend.retries

    def attempt_groups(pending: list[int], attempts: list[int]) -> list[list]:
        episodes = [
            Episode(g * n_samples + j, g, tasks[g].content, tasks[g].label, max_turns=settings.max_turns)
            for g in pending
            for j in range(n_samples)
        ]
        seeds = [
            request_seed(seed, rollout, g * n_samples + j, attempt)
            for g, attempt in zip(pending, attempts)
            for j in range(n_samples)
        ]
        if runner.agent.style == "group":  # the harness plays each task's group itself
            firsts = episodes[::n_samples]
            seed_groups = [seeds[i * n_samples : (i + 1) * n_samples] for i in range(len(pending))]
            return asyncio.run(_play_groups(runner, firsts, seed_groups, n_samples, settings, rollout))
        results = asyncio.run(_play_all(runner, episodes, seeds, settings, rollout))
        return [results[i * n_samples : (i + 1) * n_samples] for i in range(len(pending))]

    answered, stats = complete_groups(
        len(tasks),
        attempt_groups,
        lambda result: result.error,
        policy=failed_group_policy,
        max_regenerations=max_regenerations,
        rollout=rollout,
    )
    stats.retries = runner.store.backend.retries - retries_before
    samples: list[Sample] = []
    episode = 0
    for position, g in enumerate(sorted(answered)):
        for result in answered[g]:
            for s in result.samples:
                s.index, s.group = len(samples), position
                s.metadata["episode"] = episode
                s.metadata["prompt"] = g
                samples.append(s)
            episode += 1
    return samples, stats


async def _play_all(
    runner: AgentRunner, episodes: list[Episode], seeds: list[int], settings: SessionSettings, rollout: int
):
    return await asyncio.gather(
        *(runner.episode(ep, seed=s, settings=settings, rollout=rollout) for ep, s in zip(episodes, seeds))
    )


async def _play_groups(runner: AgentRunner, firsts: list[Episode], seeds, n: int, settings, rollout: int):
    return await asyncio.gather(
        *(runner.group(ep, n, seeds=s, settings=settings, rollout=rollout) for ep, s in zip(firsts, seeds))
    )
