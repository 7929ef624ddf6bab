"""Partial rollouts (slime's ``--partial-rollout``, the Kimi k1.5 scheme): over-sample, train the groups that finish
first, keep the tokens of the others and continue them in a later rollout, so that no generated token is thrown
away.

A rollout sends ``over_sampling`` groups at once: the groups kept from earlier rollouts first (the oldest first),
then fresh prompts. Once ``target`` groups have every sample finished, the requests still running are stopped
(``backend.stop``: SGLang's ``/abort_request``, ``Engine.stop`` in process); each answers with the tokens it has,
with their supports, log mu and weight versions, captured when they were sampled. A finished group trains; an
unfinished one is kept whole (its finished samples as they are, the others with their tokens so far) and its
unfinished samples are continued next time from ``prompt + kept tokens``, asking for the tokens left of
``max_new_tokens``: nothing kept is generated again. A sample may so hold tokens of several weight versions, each
replayed under the version that sampled it (``weight_versions`` spans; the trainer's lagged scorer). Groups finished
beyond ``target`` are kept too, and train first in the next rollout.

Under ``--max-policy-lag`` L, a kept group whose oldest tokens are L pushes old when this rollout trains is not
stopped again (the stop waits for it, and it trains first): kept once more, those tokens would be older than the lag.
With ``over_sampling`` at most ``2 * target`` at most ``target`` groups are kept, so none ever ages out. Beyond
that, a kept group with a finished sample whose every token is older than the lag could train nothing of that
sample: it is dropped when taken from the buffer (counted, its tokens too), before any of its samples is continued,
and the over-sampling fills its place, so a rollout still trains ``target`` groups (as slime's dynamic filter: a
filtered group does not count toward the batch).

Each continued request restarts the engine's penalty history at its first output (``output_starts``, which the
trainer replays), and ``prompt + kept`` is prefilled under the weights current then: the same recompute as a
retracted request (engine/pausing.py).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from ..errors import ConfigError, EngineUnavailable
from ..protocol import GenerateRequest, beyond_lag
from .data import Prompt
from .generate import Asked, RolloutStats, _request, render_prompt, reward_of
from .sample import Sample
from .trajectory import Trajectory

log = logging.getLogger(__name__)


@dataclass(eq=False)  # a group is itself: compared by identity
class KeptGroup:
    """One prompt's ``n`` samples across rollouts: each a ``Trajectory`` of its segments, and which are finished."""

    number: int  # the prompt's place in the run's stream of training prompts
    prompt: Prompt
    ids: list[int]
    text: str
    samples: list[Trajectory]
    finished: list[bool]
    first_rollout: int
    segments: list[int] = field(default_factory=list)  # requests sent so far, per sample

    @property
    def done(self) -> bool:
        return all(self.finished)

    @property
    def kept_tokens(self) -> int:
        """Every token it holds: its finished samples wait for the others, and all train together later."""
        return sum(t.response_length for t in self.samples)

    @property
    def kept_capture_ids(self) -> int:
        """The support ids its tokens captured: what the trainer holds for it (the capture budget's unit)."""
        return sum(table.nnz for t in self.samples for table in t.supports)

    def oldest_age(self, ages: dict[str, int]) -> int | None:
        """The age its oldest token will have when this rollout trains (a version never pushed: None)."""
        found = [ages.get(span.version) for t in self.samples for span in t.spans]
        return None if not found or None in found else max(found)

    def too_old(self, ages: dict[str, int], max_lag: int) -> bool:
        """A finished sample has no model token sampled at most ``max_lag`` pushes ago (``ages``: each pushed
        version's age; a version never pushed counts as older): it could train nothing, and never will."""
        return any(done and not _has_live_token(t, ages, max_lag) for t, done in zip(self.samples, self.finished))


def _has_live_token(t: Trajectory, ages: dict[str, int], max_lag: int) -> bool:
    if not t.versions_known:  # no versions to age: the trainer's lag check names it
        return True
    mask = np.concatenate(t.loss_mask) if t.loss_mask else np.zeros(0, np.int8)
    return any(mask[s.start : s.end].any() for s in t.spans if not beyond_lag(s, ages, max_lag))


@dataclass
class PartialStats(RolloutStats):
    generated_tokens: int = 0  # sampled in this rollout
    trained_tokens: int = 0  # in the groups this rollout trains
    kept_tokens: int = 0  # in the groups kept for a later rollout (their finished samples too)
    continued_samples: int = 0  # requests that went on from kept tokens
    stopped_requests: int = 0  # stopped once enough groups had finished
    kept_groups: int = 0
    oldest_kept_rollout: int = -1
    kept_capture_ids: int = 0  # support ids the kept groups hold (--max-kept-capture-ids)
    over_sampling_held: int = 0  # fresh groups not sent because the kept ones held the capture budget
    lag_dropped_kept_groups: int = 0  # kept groups with a finished sample older than --max-policy-lag, dropped
    lag_dropped_kept_tokens: int = 0  # every token they held: generated, never trained
    failed_stops: int = 0  # stops an engine did not take (its requests ran on to their end, nothing lost)


class PartialRollouts:
    """The buffer of kept groups and one rollout's generation over it (rank 0)."""

    def __init__(
        self,
        target: int,
        over_sampling: int,
        max_rounds: int = 3,
        max_kept_capture_ids: int = 1 << 26,
        max_lag: int | None = None,
    ):
        if over_sampling < target:
            raise ConfigError(
                f"over_sampling_batch_size: {over_sampling} groups is fewer than the {target} a rollout trains"
            )
        self.target, self.over_sampling, self.max_rounds = target, over_sampling, max_rounds
        self.max_kept_capture_ids, self.max_lag = max_kept_capture_ids, max_lag
        self.kept: deque[KeptGroup] = deque()
        self.next_prompt = 0  # how many fresh prompts the run has taken

    def generate(
        self,
        backend,
        tokenizer,
        prompts,
        asked: Asked,
        *,
        reward_fn,
        rollout: int,
        seed: int,
        rid_prefix: str,
        ages: dict[str, int] | None = None,
    ) -> tuple[list[Sample], PartialStats]:
        """The samples of ``target`` finished groups (in prompt order), rewarded; the rest kept. ``prompts[i]``: the
        run's i-th training prompt. ``ages``: each pushed version's age when this rollout trains (no push comes
        between: partial rollouts are synchronous), which drops the kept groups too old to train under max_lag."""
        stats = PartialStats()
        trained: list[KeptGroup] = []
        for _ in range(self.max_rounds):
            groups = self._groups(tokenizer, prompts, asked, rollout, stats, ages)
            ready = [g for g in groups if g.done]  # finished in an earlier rollout beyond its target
            running = [g for g in groups if not g.done]
            last_chance = self._last_chance(running, ages)
            self._run(running, ready, last_chance, backend, asked, rollout, seed, rid_prefix, stats)
            finished = [g for g in groups if g.done]  # the kept ones first: the oldest work trains first
            trained += finished[: self.target - len(trained)]
            for g in reversed(groups):
                if not any(g is t for t in trained):
                    self.kept.appendleft(g)  # the oldest stay first
            if len(trained) >= self.target:
                break
        else:
            raise EngineUnavailable(
                f"rollout {rollout}: {len(trained)} of {self.target} groups finished after {self.max_rounds} rounds "
                f"({stats.failed_samples} requests failed)"
            )
        trained.sort(key=lambda g: g.number)
        stats.kept_groups = len(self.kept)
        stats.kept_tokens = sum(g.kept_tokens for g in self.kept)
        stats.kept_capture_ids = sum(g.kept_capture_ids for g in self.kept)
        stats.oldest_kept_rollout = min((g.first_rollout for g in self.kept), default=-1)
        samples = self._samples(trained, tokenizer, asked, reward_fn, rollout)
        stats.trained_tokens = sum(len(s.response_ids) for s in samples)
        return samples, stats

    def _groups(self, tokenizer, prompts, asked: Asked, rollout: int, stats: PartialStats, ages) -> list[KeptGroup]:
        """``over_sampling`` groups: the kept ones (less those too old to train), then fresh prompts; while the kept
        ones hold more support ids than ``max_kept_capture_ids``, fresh prompts only up to ``target`` (the buffer
        drains, nothing dropped)."""
        groups = []
        while self.kept and len(groups) < self.over_sampling:
            g = self.kept.popleft()
            if ages is not None and self.max_lag is not None and g.too_old(ages, self.max_lag):
                stats.lag_dropped_kept_groups += 1
                stats.lag_dropped_kept_tokens += g.kept_tokens
                continue
            groups.append(g)
        held = sum(g.kept_capture_ids for g in groups) + sum(g.kept_capture_ids for g in self.kept)
        room = self.over_sampling if held <= self.max_kept_capture_ids else max(self.target, len(groups))
        stats.over_sampling_held += self.over_sampling - room
        while len(groups) < room:
            prompt = prompts[self.next_prompt]
            ids, text = render_prompt(tokenizer, prompt, asked.apply_chat_template)
            groups.append(
                KeptGroup(
                    self.next_prompt,
                    prompt,
                    ids,
                    text,
                    [
                        Trajectory(list(ids), text, asked.capture, penalties=asked.penalties)
                        for _ in range(asked.n_samples)
                    ],
                    [False] * asked.n_samples,
                    rollout,
                    [0] * asked.n_samples,
                )
            )
            self.next_prompt += 1
        return groups

    def _last_chance(self, groups: list[KeptGroup], ages) -> set[int]:
        """The kept groups whose oldest tokens are ``max_lag`` pushes old when this rollout trains: kept once more,
        they would be older than the lag next time (masked, or the group dropped), so they are not stopped."""
        if ages is None or self.max_lag is None:
            return set()
        return {id(g) for g in groups if (g.oldest_age(ages) or 0) >= self.max_lag}

    def _run(self, groups, ready, last_chance, backend, asked, rollout, seed, rid_prefix, stats: PartialStats) -> None:
        """Every unfinished sample of ``groups`` continued; the running ones stopped once ``target`` groups (with
        ``ready``) are finished and none of ``last_chance`` (ids) is still running."""
        slots: list[tuple[KeptGroup, int, GenerateRequest]] = []
        for g in groups:
            for j, (trajectory, done) in enumerate(zip(g.samples, g.finished)):
                if done:
                    continue
                left = asked.max_new_tokens - trajectory.response_length
                k = g.number * asked.n_samples + j
                req = _request(trajectory.ids, asked, seed, rollout, k, g.segments[j], f"{rid_prefix}/partial")
                req = replace(req, max_new_tokens=left)
                stats.continued_samples += trajectory.response_length > 0
                g.segments[j] += 1
                slots.append((g, j, req))
        if not slots:
            return
        lock, stopped = threading.Lock(), threading.Event()
        waiting = {id(g): sum(not f for f in g.finished) for g in groups}
        complete, answered = [len(ready)], set()
        holding = set(last_chance)  # last-chance groups still running (each has an unfinished sample)

        def on_done(i: int, finished: bool) -> None:
            g = slots[i][0]
            with lock:
                answered.add(i)
                if not finished:  # stopped or failed: its group is not finished in this rollout
                    waiting[id(g)] = -1
                    holding.discard(id(g))
                else:
                    waiting[id(g)] -= 1
                    if waiting[id(g)] == 0:
                        complete[0] += 1
                        holding.discard(id(g))
                enough = complete[0] >= self.target and not holding and not stopped.is_set()
                if enough:
                    stopped.set()
                    rest = [r for n, (_, _, r) in enumerate(slots) if n not in answered]
            if enough and rest:
                stats.stopped_requests += len(rest)
                try:
                    backend.stop(rest)
                except EngineUnavailable as exc:  # the answer that came keeps; the rest run to their end
                    stats.failed_stops += 1
                    log.warning("rollout %d: %s", rollout, exc)

        answers = backend.generate([r for _, _, r in slots], return_exceptions=True, on_done=on_done, partial=True)
        for (g, j, _), answer in zip(slots, answers):
            if isinstance(answer, Exception):
                stats.failed_samples += 1
                continue
            trajectory = g.samples[j]
            if answer.num_tokens == 0:  # stopped in the engine's waiting queue: resubmitted as it was
                g.finished[j] = False
                g.segments[j] -= 1  # a segment that sampled nothing is not one
                continue
            trajectory.append_turn([], answer)
            stats.generated_tokens += answer.num_tokens
            full = trajectory.response_length >= asked.max_new_tokens
            if full and answer.finish_reason.get("type") == "abort":
                trajectory.finish_reason = {"type": "length", "length": asked.max_new_tokens}  # stopped at its end
            g.finished[j] = full or answer.finish_reason.get("type") != "abort"

    @staticmethod
    def _samples(groups: list[KeptGroup], tokenizer, asked: Asked, reward_fn, rollout: int) -> list[Sample]:
        samples = []
        for position, g in enumerate(groups):
            for j, trajectory in enumerate(g.samples):
                text = tokenizer.decode(trajectory.response_ids, skip_special_tokens=True)
                sample = trajectory.to_sample(
                    len(samples),
                    position,
                    reward=reward_of(reward_fn, g.text, text, g.prompt.label, rollout, len(samples)),
                    temperature=asked.params.temperature,
                    label=g.prompt.label,
                    response_text=text,
                    metadata={"prompt": g.number, "partial_segments": g.segments[j], "first_rollout": g.first_rollout},
                )
                samples.append(sample)
        return samples
