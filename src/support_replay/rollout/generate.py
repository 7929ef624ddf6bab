"""Single-turn rollouts through any backend: prompts in, Samples out.

The backend validated every completion where it entered this process; the Samples built
from them are trusted from here on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..core.penalties import NO_PENALTIES, Penalties
from ..core.routing import needed_history
from ..core.sampling import SamplingParams
from ..errors import ConfigError, EngineOverloaded, EngineUnavailable, NonFiniteError
from ..protocol import GenerateRequest
from .data import Prompt
from .sample import Sample


def render_prompt(tokenizer, prompt: Prompt, apply_chat_template: bool) -> tuple[list[int], str]:
    """Token ids and text of a prompt; chat messages always go through the chat template."""
    if isinstance(prompt.content, list) or apply_chat_template:
        messages = prompt.content if isinstance(prompt.content, list) else [{"role": "user", "content": prompt.content}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"], text
    return tokenizer(prompt.content)["input_ids"], prompt.content


def validate_request(req: GenerateRequest, rollout_temperature: float, index: int) -> GenerateRequest:
    """A request that captures a support must sample at the run's rollout temperature: the
    trainer divides the actor's logits by that one value (docs/contract.md)."""
    if req.return_sampling_mask and req.params.temperature != rollout_temperature:
        raise ConfigError(
            f"request {index}: temperature {req.params.temperature} differs from the rollout temperature "
            f"{rollout_temperature} the trainer scores with (--rollout-temperature)"
        )
    return req


def request_seed(base: int, rollout: int, k: int, attempt: int = 0) -> int:
    """A seed per (run, rollout, sample, attempt): the same rollout draws the same tokens after a resume."""
    return (base * 1_000_003 + rollout * 100_003 + k + attempt * 7_919_000_000) % (2**62)


FAILED_GROUP_POLICIES = ("regenerate", "drop")


@dataclass(frozen=True)
class Asked:
    """What every request of a rollout asks of the engine: ``n_samples`` responses per prompt of up to
    ``max_new_tokens``, sampled with ``params``. ``capture``: return S_t and log mu. ``ignore_eos``: every response
    runs to ``max_new_tokens``, past end-of-sequence (fixed-length benchmarks). ``routing``: the experts a MoE
    engine routed every position to (routing replay). ``support_logprobs``: the sampler's log q of every support id
    too (score centering). ``sent_sampling_fields``: the sampling settings sent explicitly (None: all; the audit
    sends what a user's client would)."""

    params: SamplingParams
    n_samples: int
    max_new_tokens: int
    capture: bool
    penalties: Penalties = NO_PENALTIES
    ignore_eos: bool = False
    routing: bool = False
    support_logprobs: bool = False
    sent_sampling_fields: frozenset[str] | None = None
    apply_chat_template: bool = False


@dataclass(frozen=True)
class OnFailure:
    """A group with a response the engine never gave: generated again (up to ``max_regenerations`` times, then
    the run stops) or dropped."""

    policy: str = "regenerate"
    max_regenerations: int = 2


@dataclass
class RolloutStats:
    """What went wrong on the way, for the metrics: responses that never came, and what was done."""

    failed_samples: int = 0
    regenerated_groups: int = 0
    dropped_groups: int = 0
    retries: int = 0


def complete_groups(
    num_groups: int, attempt_groups, error_of, *, policy: str, max_regenerations: int, rollout: int
) -> tuple[dict, RolloutStats]:
    """Every group answered in full, or regenerated / dropped by ``policy``.

    ``attempt_groups(pending, attempts)`` plays the pending groups once, group ``pending[i]`` with the
    seeds of attempt ``attempts[i]``, and returns one list of results per group; ``error_of(result)``
    is the exception of a result that failed, or None. A group whose every failure is
    ``EngineOverloaded`` (nothing of it ran) keeps its attempt, so it draws the seeds the first try
    would have; any other failure moves it to fresh seeds. Either way it counts as a regeneration.
    Returns ``{group: results}`` of the complete groups and what was done on the way.
    """
    if policy not in FAILED_GROUP_POLICIES:
        raise ConfigError(f"failed_group_policy: one of {FAILED_GROUP_POLICIES}, got {policy!r}")
    stats, answered = RolloutStats(), {}
    pending, attempts, tries = list(range(num_groups)), [0] * num_groups, 0
    while pending:
        failed = []
        for g, attempt, group in zip(pending, attempts, attempt_groups(pending, attempts)):
            errors = [e for e in map(error_of, group) if e is not None]
            stats.failed_samples += len(errors)
            if errors:
                overloaded = all(isinstance(e, EngineOverloaded) for e in errors)
                failed.append((g, attempt if overloaded else attempt + 1, errors[0]))
            else:
                answered[g] = group
        if not failed:
            break
        if policy == "drop":
            stats.dropped_groups += len(failed)
            break
        if tries >= max_regenerations:
            g, _, error = failed[0]
            raise EngineUnavailable(
                f"rollout {rollout}, group {g}: no complete answer after {tries + 1} attempts "
                f"({type(error).__name__}: {error})"
            )
        stats.regenerated_groups += len(failed)
        pending, attempts, tries = [g for g, _, _ in failed], [a for _, a, _ in failed], tries + 1
    return answered, stats


def generate_samples(
    backend,
    tokenizer,
    prompts: list[Prompt],
    asked: Asked,
    *,
    reward_fn,
    rollout: int,
    seed: int,
    rid_prefix: str | None = None,
    on_failure: OnFailure = OnFailure(),
) -> tuple[list[Sample], RolloutStats]:
    """``asked.n_samples`` responses per prompt, grouped prompt by prompt, rewarded.

    A response the engine never gave (down, overloaded, aborted: ``EngineUnavailable``) never
    trains: its whole GRPO group is generated again, with fresh seeds unless nothing of it ran, or
    dropped, by ``on_failure``. Every request carries an id ``{rid_prefix}/{rollout}/{sample}/{attempt}``,
    so an engine that receives it twice answers once.
    """
    rendered = [render_prompt(tokenizer, p, asked.apply_chat_template) for p in prompts]
    n_samples = asked.n_samples
    retries_before = backend.retries

    def attempt_groups(pending: list[int], attempts: list[int]) -> list[list]:
        requests = [
            _request(rendered[g][0], asked, seed, rollout, g * n_samples + j, attempt, rid_prefix)
            for g, attempt in zip(pending, attempts)
            for j in range(n_samples)
        ]
        completions = backend.generate(requests, return_exceptions=True)
        pairs = list(zip(requests, completions))
        return [pairs[i * n_samples : (i + 1) * n_samples] for i in range(len(pending))]

    answered, stats = complete_groups(
        len(prompts),
        attempt_groups,
        lambda pair: pair[1] if isinstance(pair[1], Exception) else None,
        policy=on_failure.policy,
        max_regenerations=on_failure.max_regenerations,
        rollout=rollout,
    )
    stats.retries = backend.retries - retries_before
    samples = []
    for position, g in enumerate(sorted(answered)):
        for req, c in answered[g]:
            samples.append(
                _sample(len(samples), position, req, c, rendered[g][1], prompts[g], tokenizer, reward_fn, rollout)
            )
            samples[-1].metadata["prompt"] = g  # which of ``prompts``: a stale group is generated again from it
            if c.sampler is not None:  # what the engine reports it sampled with (checked against the request)
                samples[-1].metadata["sampler"] = c.sampler
    return samples, stats


def _request(ids, asked: Asked, seed: int, rollout: int, k: int, attempt: int, rid_prefix) -> GenerateRequest:
    params = asked.params
    sp = SamplingParams(
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        seed=request_seed(seed, rollout, k, attempt),
    )
    rid = None if rid_prefix is None else f"{rid_prefix}/{rollout}/{k}/{attempt}"
    req = GenerateRequest(
        list(ids),
        sp,
        max_new_tokens=asked.max_new_tokens,
        return_sampling_mask=asked.capture,
        rid=rid,
        penalties=asked.penalties,
        ignore_eos=asked.ignore_eos,
        return_routed_experts=asked.routing,
        sampling_logprobs_mode="support" if asked.capture and asked.support_logprobs else "selected",
        sent_sampling_fields=asked.sent_sampling_fields,
    )
    return validate_request(req, params.temperature, k)


def reward_of(reward_fn, prompt_text: str, text: str, label, rollout: int, index: int) -> float:
    """The reward of one answer; ``NonFiniteError`` naming the sample where it is not a finite number."""
    reward = float(reward_fn(prompt_text, text, label))
    if not math.isfinite(reward):
        raise NonFiniteError(
            f"rollout {rollout}, sample {index}: the reward function returned {reward}; nothing of this rollout trains"
        )
    return reward


def _sample(
    index: int,
    group: int,
    req: GenerateRequest,
    c,
    prompt_text: str,
    prompt: Prompt,
    tokenizer,
    reward_fn,
    rollout: int,
) -> Sample:
    text = tokenizer.decode(c.output_ids, skip_special_tokens=True)
    reward = reward_of(reward_fn, prompt_text, text, prompt.label, rollout, index)
    return Sample(
        index=index,
        group=group,
        prompt_ids=list(req.input_ids),
        response_ids=list(c.output_ids),
        loss_mask=np.ones(len(c.output_ids), np.int8),
        reward=reward,
        status="truncated" if c.finish_reason.get("type") == "length" else "completed",
        log_mu=c.log_mu,
        full_logprobs=c.full_logprobs,
        support=c.support,
        temperature=req.params.temperature,
        label=prompt.label,
        prompt_text=prompt_text,
        response_text=text,
        weight_versions=c.weight_versions,
        support_bytes=c.support_bytes,
        penalties=req.penalties,
        routing=c.routed_experts,
        routing_history=needed_history(c.routed_experts_history or [], c.routed_experts),
        routing_bytes=c.routing_bytes,
        support_logq=np.concatenate(c.support_row_logprobs).astype(np.float32) if c.support_row_logprobs else None,
    )
