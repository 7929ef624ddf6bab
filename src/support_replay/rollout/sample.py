"""The training sample, and the rule set a sample passes where it enters (docs/contract.md).

Samples built from backend completions were validated as completions already
(``protocol.validate_completion``); ``validate_sample`` is for samples that enter the
trainer any other way (assembled by a session, handed in by user code).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..core.penalties import NO_PENALTIES, Penalties
from ..core.routing import RoutingShape, routing_problem
from ..core.support import SupportTable
from ..errors import SampleError, SupportError
from ..protocol import VersionSpan


@dataclass
class Sample:
    """One response to one prompt, token level.

    ``loss_mask[t]`` is 1 for tokens the model sampled and 0 for inserted ones
    (environment, tool); inserted tokens carry the singleton support ``{a_t}`` and log mu 0.
    """

    index: int
    group: int
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: np.ndarray  # int8 [R]
    reward: float = 0.0
    status: str = "completed"  # completed | truncated | aborted
    log_mu: np.ndarray | None = None  # support-normalised rollout log-prob per response token (float32)
    full_logprobs: np.ndarray | None = None  # the engine's full-vocabulary log-probs, when asked
    support: SupportTable | None = None
    temperature: float = 1.0
    label: str | None = None
    prompt_text: str = ""
    response_text: str = ""
    weight_versions: list[VersionSpan] = field(default_factory=list)
    support_bytes: int = 0  # what the support cost on the wire
    metadata: dict = field(default_factory=dict)
    penalties: Penalties = NO_PENALTIES  # the penalties and logit bias it was sampled with
    output_starts: list[int] = field(
        default_factory=lambda: [0]
    )  # response positions where an engine request began its output
    # [prompt + response - 1, layers, top_k] int32: the experts that computed each position (core/routing.py);
    # FREE (-1) rows only after the last sampled token (inserted tokens no engine fed)
    routing: np.ndarray | None = None
    # the sampler's log q of every support id, flat float32 aligned with ``support.ids`` (score centering)
    support_logq: np.ndarray | None = None
    # earlier computations of a prefix that a later one routed again (a retract's recompute, a continued partial
    # sample, a session's next turn), oldest first: each [prompt + e - 1, layers, top_k] routed the response tokens
    # from the previous one's e to its own e; ``routing`` routed the rest (``routing_segments``)
    routing_history: list[np.ndarray] = field(default_factory=list)
    routing_bytes: int = 0  # what the routing cost on the wire
    # (token-layer choices of decoded tokens whose routing differed when a later turn prefilled them, compared)
    routing_recomputed: tuple[int, int] = (0, 0)

    @property
    def response_length(self) -> int:
        return len(self.response_ids)


def validate_sample(sample: Sample, vocab_size: int, *, replay: bool, temperature: float) -> Sample:
    """Raise ``SampleError`` naming the sample, the token and the rule, or return the sample."""
    name = f"sample {sample.index}"
    n = sample.response_length
    if n == 0:
        raise SampleError(f"{name}: empty response")
    if len(sample.loss_mask) != n:
        raise SampleError(f"{name}: loss mask of {len(sample.loss_mask)} for {n} response tokens")
    if sample.temperature != temperature:
        raise SampleError(
            f"{name}: sampled at temperature {sample.temperature}, but the rollout temperature is {temperature}"
        )
    ids = np.asarray(sample.prompt_ids + sample.response_ids)
    if ids.min() < 0 or ids.max() >= vocab_size:
        raise SampleError(
            f"{name}: token {int(ids[(ids < 0) | (ids >= vocab_size)][0])} outside the vocabulary [0, {vocab_size})"
        )
    if not replay:
        return sample
    if sample.support is None or sample.log_mu is None:
        raise SampleError(f"{name}: replay is on but the sample carries no support / rollout log mu")
    if sample.support.num_rows != n:
        raise SampleError(f"{name}: support has {sample.support.num_rows} rows for {n} response tokens")
    if len(sample.log_mu) != n:
        raise SampleError(f"{name}: {len(sample.log_mu)} rollout log-probs for {n} response tokens")
    try:
        sample.support.validate(vocab_size, sample.response_ids, name=name + " support")
    except SupportError as exc:
        raise SampleError(str(exc)) from exc
    lp = np.asarray(sample.log_mu, np.float64)
    bad = ~np.isfinite(lp)
    if bad.any():
        raise SampleError(f"{name} token {int(np.flatnonzero(bad)[0])}: rollout log mu {lp[bad][0]} is not finite")
    inserted = np.asarray(sample.loss_mask) == 0
    sizes = sample.support.sizes()
    wrong = inserted & ((sizes != 1) | (lp != 0))
    if wrong.any():
        t = int(np.flatnonzero(wrong)[0])
        raise SampleError(
            f"{name} token {t}: an inserted token needs the singleton support and log mu 0 (|S|={int(sizes[t])}, log "
            f"mu={lp[t]})"
        )
    return sample


def check_sample_routing(sample: Sample, shape: RoutingShape | None) -> None:
    """Routing replay's rules for one sample: routing present, every position up to the last sampled
    token routed, fitting the model (``shape``; None: a dense model, refused)."""
    name = f"sample {sample.index}"
    if shape is None:
        raise SampleError(f"{name}: --use-rollout-routing-replay on a dense model (it has no experts to route)")
    routed = sample.routing
    if routed is None:
        raise SampleError(
            f"{name}: --use-rollout-routing-replay is on but the sample carries no routed experts (the engine must "
            "capture them: return_routed_experts)"
        )
    positions = len(sample.prompt_ids) + sample.response_length - 1
    free = (routed < 0).all(axis=(1, 2)) if routed.ndim == 3 else None
    if free is not None and routed.shape[0] == positions:
        sampled = np.flatnonzero(np.asarray(sample.loss_mask) == 1)
        last = len(sample.prompt_ids) + int(sampled[-1]) - 1 if len(sampled) else 0  # what computes the last one
        missing = np.flatnonzero(free[: last + 1])
        if len(missing):
            raise SampleError(f"{name}: position {int(missing[0])} has no routing, and a sampled token follows it")
        routed = routed[: last + 1]
        positions = last + 1
    problem = routing_problem(routed, positions, shape)
    if problem is not None:
        raise SampleError(f"{name}: {problem}")
    start = 0
    for k, earlier in enumerate(sample.routing_history):
        end = earlier.shape[0] - len(sample.prompt_ids) + 1 if earlier.ndim == 3 else -1
        if not start < end < sample.response_length:
            raise SampleError(
                f"{name}: routing_history[{k}] covers {earlier.shape[0]} positions: not its prompt's "
                f"{len(sample.prompt_ids)} with more response tokens than the computation before it and fewer "
                f"than the {sample.response_length} of the sample"
            )
        problem = routing_problem(earlier, earlier.shape[0], shape)
        if problem is not None:
            raise SampleError(f"{name}: routing_history[{k}]: {problem}")
        start = end


def routing_segments(sample: Sample) -> list[tuple[int, int, np.ndarray]]:
    """``(start, end, routing)`` for the response tokens ``[start, end)`` an earlier computation sampled: scored
    under its routing, in a forward of their own over ``prompt + response[:end]``; the tokens after the last
    are scored under ``sample.routing`` (``check_sample_routing`` checked the history)."""
    segments, start = [], 0
    for earlier in sample.routing_history:
        end = len(earlier) - len(sample.prompt_ids) + 1
        segments.append((start, end, earlier))
        start = end
    return segments


def check_sample_support_logq(sample: Sample) -> None:
    """Score centering's rule for one sample: the sampler's log q of every support id, one finite value each
    (a model token's row was validated where its completion entered; inserted tokens carry log q 0)."""
    name = f"sample {sample.index}"
    if sample.support is None or sample.support_logq is None:
        raise SampleError(
            f"{name}: --use-score-centering is on but the sample carries no log q per support id (the engine must "
            "answer sampling_logprobs_mode 'support')"
        )
    ids = int(sample.support.offsets[-1])
    if len(sample.support_logq) != ids or not np.isfinite(sample.support_logq).all():
        raise SampleError(f"{name}: {len(sample.support_logq)} log q values for {ids} support ids, or one not finite")
