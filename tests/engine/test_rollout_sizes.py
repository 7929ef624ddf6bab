"""Rollouts larger than the engine's queue: every path keeps at most what the engine admits in
flight, so nothing fails for a full queue, and a group that failed only for overload draws the
seeds its first try would have."""

import pytest

from support_replay import SamplingParams
from support_replay.backends.local import EngineBackend
from support_replay.engine import Engine, EngineSettings
from support_replay.engine.limits import EngineLimits
from support_replay.errors import EngineOverloaded, EngineUnavailable
from support_replay.protocol import GenerateRequest
from support_replay.rollout.data import Prompt
from support_replay.rollout.generate import Asked, complete_groups, generate_samples


def test_an_in_process_rollout_of_twice_the_queue_fails_nothing(tiny_checkpoint):
    engine = Engine.from_pretrained(
        tiny_checkpoint, EngineSettings(limits=EngineLimits(max_queue=16, max_batch_size=8))
    )
    backend = EngineBackend(engine)
    seen_waiting = []
    original = engine.submit_all
    engine.submit_all = lambda reqs: seen_waiting.append(engine.num_waiting + len(reqs)) or original(reqs)
    prompts = [Prompt(f"{i} + {i}", str(2 * i)) for i in range(8)]
    samples, stats = generate_samples(
        backend,
        engine.tokenizer,
        prompts,
        Asked(SamplingParams(top_k=20, top_p=0.9), n_samples=4, max_new_tokens=4, capture=True),
        reward_fn=lambda p, r, label: 0.0,
        rollout=0,
        seed=1,
    )
    assert len(samples) == 32 and stats.failed_samples == 0 and stats.regenerated_groups == 0
    assert max(seen_waiting) <= 16 and len(seen_waiting) > 1  # queued as room allowed, never past the queue
    assert engine.stats.requests["overloaded"] == 0


def test_a_full_queue_still_answers_503_to_a_caller_that_overloads_it(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(limits=EngineLimits(max_queue=2, max_batch_size=2)))
    reqs = [GenerateRequest([5, 6], SamplingParams(top_k=5, seed=i), max_new_tokens=2) for i in range(3)]
    futures = [engine.submit(r) for r in reqs]
    assert futures[2].exception().status == 503
    engine.wait(futures[:2])


def test_a_group_failed_by_overload_alone_keeps_its_seeds():
    calls = []

    def attempt_groups(pending, attempts):
        calls.append(list(zip(pending, attempts)))
        first = len(calls) == 1
        return [
            [
                EngineOverloaded("queue full")
                if first and g == 0
                else EngineUnavailable("down")
                if first and g == 1
                else None
            ]
            for g in pending
        ]

    answered, stats = complete_groups(
        3, attempt_groups, lambda r: r, policy="regenerate", max_regenerations=2, rollout=0
    )
    assert sorted(answered) == [0, 1, 2] and stats.regenerated_groups == 2 and stats.failed_samples == 2
    assert calls == [
        [(0, 0), (1, 0), (2, 0)],
        [(0, 0), (1, 1)],
    ]  # overloaded: attempt 0 again; failed otherwise: fresh seeds


def test_regenerations_count_overloads_too():
    with pytest.raises(EngineUnavailable, match="group 0: no complete answer after 3 attempts"):
        complete_groups(
            1,
            lambda pending, attempts: [[EngineOverloaded("full")]],
            lambda r: r,
            policy="regenerate",
            max_regenerations=2,
            rollout=0,
        )


def test_every_503_try_is_overload_and_a_mix_is_not():
    import httpx

    from support_replay.backends.base import post_json

    for statuses, kind in (([503] * 4, EngineOverloaded), ([503, 502, 503, 503], EngineUnavailable)):
        replies = iter(statuses)
        client = httpx.Client(
            transport=httpx.MockTransport(lambda request: httpx.Response(next(replies), headers={"retry-after": "0"}))
        )
        with pytest.raises(EngineUnavailable) as err:
            post_json(client, "http://engine/generate", {}, 0)
        assert type(err.value) is kind
