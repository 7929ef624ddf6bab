"""What a rollout client asks an engine for, and the one record every backend returns.

The embedded engine, the HTTP backends, rollout and the trainer all import this module;
it depends on the core alone (no engine, no model, no HTTP), so describing a request
never loads a model.

A ``Completion`` is validated once, where it enters the trainer's process
(``validate_completion``, called by every backend); later stages trust it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from .core.penalties import NO_PENALTIES, Penalties
from .core.routing import RoutingShape, routing_problem
from .core.sampling import SamplingParams
from .core.support import SupportTable
from .errors import RequestError, SamplerMismatch, SupportError, WireError

LOGPROBS_MODES = ("selected", "support")
# the sampling settings a client may leave out of a request (the engine then applies its own default)
SAMPLING_FIELDS = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
)
DEFAULT_SAMPLING_MASK_MAX_TOKENS = 4096  # SGLang's --sampling-mask-max-tokens default
SESSION_HEADER = "X-Session-Id"  # a router keeps every request with the same value on one engine
DEFAULT_WEIGHT_VERSION = "default"  # SGLang's name for the weights a server started with


@dataclass
class GenerateRequest:
    """One prompt to complete, already tokenized.

    ``return_sampling_mask`` asks for the realized support and log mu of every generated
    token (replay); ``return_logprob`` for the full-vocabulary log-prob of every generated
    token; ``sampling_logprobs_mode="support"`` also for log mu of every id of each
    support (SGLang's field names); ``return_routed_experts`` for the experts a mixture-of-experts
    model routed every prompt and output position to (``Completion.routed_experts``).
    """

    input_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    max_new_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # vLLM's min_tokens / SGLang's min_new_tokens: EOS and the stop tokens are masked out before the filters
    # (so they are outside the captured support) and stop strings do not end the output until then
    min_new_tokens: int = 0
    skip_special_tokens: bool = True  # the text only: output_ids keep every token
    spaces_between_special_tokens: bool = True  # vLLM's: False joins adjacent special tokens without a space
    include_stop_str_in_output: bool = False  # vLLM's (SGLang's no_stop_trim): the matched stop string or token
    # structured outputs: an llguidance grammar; the ids it forbids are masked before the filters (engine/grammar.py)
    grammar: str | None = None
    return_sampling_mask: bool = False
    return_logprob: bool = False
    # the k most likely ids of the full distribution after temperature, with their log-probs, per token (an
    # unfiltered request's top log-probs; a filtered one lists its support, sampling_logprobs_mode "support")
    top_logprobs: int = 0
    sampling_logprobs_mode: Literal["selected", "support"] = "selected"
    rid: str | None = None  # idempotency key: the same id (with the same seed) is answered once
    routing_key: str | None = None  # a session's id: a router sends every turn to the same engine
    penalties: Penalties = NO_PENALTIES  # repetition / frequency / presence penalties, logit bias
    return_routed_experts: bool = False  # SGLang's field: the top-k experts of every routed position
    lora_path: str | None = None  # SGLang's field: the loaded LoRA adapter to run with (engine/lora_adapter.py)
    # the sampling settings sent explicitly (None: every one, as the trainer does to neutralise an engine's
    # defaults); one left out takes the engine's default, as a user's own client would (the audit)
    sent_sampling_fields: frozenset[str] | None = None

    def __post_init__(self):
        if not self.input_ids:
            raise RequestError("input_ids: the prompt is empty")
        bad = next((t for t in self.input_ids if not isinstance(t, int) or isinstance(t, bool) or t < 0), None)
        if bad is not None:
            raise RequestError(f"input_ids: {bad!r} is not a token id")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens: must be an integer >= 1, got {self.max_new_tokens!r}")
        if (
            isinstance(self.min_new_tokens, bool)
            or not isinstance(self.min_new_tokens, int)
            or not 0 <= self.min_new_tokens <= self.max_new_tokens
        ):
            raise RequestError(
                f"min_new_tokens: must be an integer in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_new_tokens!r}"
            )
        if isinstance(self.top_logprobs, bool) or not isinstance(self.top_logprobs, int) or self.top_logprobs < 0:
            raise RequestError(f"top_logprobs: must be an integer >= 0, got {self.top_logprobs!r}")
        if self.rid is not None and (not isinstance(self.rid, str) or not 0 < len(self.rid) <= 256):
            raise RequestError(f"rid: must be a string of 1 to 256 characters, got {self.rid!r:.80}")
        unknown = set(self.sent_sampling_fields or ()) - set(SAMPLING_FIELDS)
        if unknown:
            raise RequestError(f"sent_sampling_fields: {sorted(unknown)} are not sampling settings {SAMPLING_FIELDS}")
        if self.sampling_logprobs_mode not in LOGPROBS_MODES:
            raise RequestError(
                f"sampling_logprobs_mode: must be one of {LOGPROBS_MODES}, got {self.sampling_logprobs_mode!r}"
            )


@dataclass(frozen=True)
class VersionSpan:
    """Output positions ``[start, end)`` were sampled by the weights named ``version``.

    The version is a string set by whoever pushed the weights (the trainer), as in
    SGLang's ``weight_versions`` and vLLM's ``weight_versions`` spans.
    """

    version: str
    start: int
    end: int

    def to_json(self) -> dict:
        return {"version": self.version, "start": self.start, "end": self.end}


def single_version(version: str, num_tokens: int) -> list[VersionSpan]:
    """Every one of ``num_tokens`` output positions sampled by ``version`` (no span for no tokens)."""
    return [VersionSpan(str(version), 0, num_tokens)] if num_tokens else []


def versions_of(spans: list[VersionSpan]) -> list[str]:
    """The distinct versions of a response, in the order they sampled."""
    out: list[str] = []
    for span in spans:
        if not out or out[-1] != span.version:
            out.append(span.version)
    return out


def beyond_lag(span: VersionSpan, ages: dict[str, int], max_lag: int) -> bool:
    """The span was sampled more than ``max_lag`` pushes ago (``ages``: each pushed version's age; a version never
    pushed counts as older): its tokens are masked, never trained (partial rollouts)."""
    return ages.get(span.version, max_lag + 1) > max_lag


@dataclass
class Completion:
    """One generated response, with its replay metadata when capture was asked for.

    ``log_mu[t]`` is the support-normalised log-prob of ``output_ids[t]`` under the
    sampling policy, ``support`` its realized support (one row per token);
    ``full_logprobs[t]`` the full-vocabulary log-prob when ``return_logprob`` was asked.
    ``weight_versions`` covers ``[0, len(output_ids))`` with the weights that sampled each
    token. ``support_bytes`` is what the support cost on the wire (0 in-process).
    """

    output_ids: list[int]
    finish_reason: dict
    log_mu: np.ndarray | None = None  # float32 [T]
    support: SupportTable | None = None
    full_logprobs: np.ndarray | None = None  # float32 [T]
    weight_versions: list[VersionSpan] = field(default_factory=list)
    text: str = ""
    support_row_logprobs: list[np.ndarray] | None = None  # "support" mode: log mu of every id of each row
    support_bytes: int = 0
    # [prompt + output - 1, layers, top_k] int32: the experts of every position fed to the model (core/routing.py)
    routed_experts: np.ndarray | None = None
    # the routing of each earlier computation of a prefix that a retract's recompute routed again, oldest first:
    # [prompt + e - 1, layers, top_k] for the outputs before the e-th, one per recompute (ours; SGLang keeps the
    # latest only)
    routed_experts_history: list[np.ndarray] | None = None
    routing_bytes: int = 0  # what the routing cost on the wire (0 in-process)
    # top_logprobs asked: per token (ids int64 [k], log-probs float32 [k]) of the full distribution, most likely first
    top_logprobs: list[tuple[np.ndarray, np.ndarray]] | None = None
    # what the engine reports it sampled with (our serve: ``meta_info["sampler"]``); SGLang and vLLM send none
    sampler: dict | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.output_ids)

    @property
    def weight_version(self) -> str | None:
        """The version that sampled the last token (SGLang's ``meta_info.weight_version``)."""
        return self.weight_versions[-1].version if self.weight_versions else None


ENGINE_NAME = "support-replay"


def sampler_record(request: GenerateRequest, *, semantics: str, version: str) -> dict:
    """What our engine sampled ``request`` with, as ``meta_info["sampler"]`` carries it: the effective
    settings and penalties (a field the client left out shows the default that applied), the filter
    semantics and the engine's name and version."""
    return {"engine": ENGINE_NAME, "version": version, "semantics": semantics, **sampling_fields(request)}


def sampling_fields(request: GenerateRequest) -> dict:
    """The request's sampling settings under the names of ``SAMPLING_FIELDS``."""
    return settings_by_field(request.params, request.penalties)


def settings_by_field(params: SamplingParams, penalties: Penalties) -> dict:
    """Sampling settings and penalties under the names of ``SAMPLING_FIELDS`` (the request fields)."""
    p = params
    return {"temperature": p.temperature, "top_k": p.top_k, "top_p": p.top_p, "min_p": p.min_p, **penalties.to_json()}


def sampler_problem(record, request: GenerateRequest) -> str | None:
    """Why an engine's sampler record disagrees with the request (a malformed record, a setting it
    sampled with other than the request's), or None."""
    if not isinstance(record, dict):
        return f"the sampler record is not an object: {record!r:.80}"
    missing = [k for k in SAMPLING_FIELDS if k not in record]
    if missing:
        return f"the sampler record lacks {missing}"
    declared = sampling_fields(request)
    for name in SAMPLING_FIELDS:
        if record[name] != declared[name]:
            return (
                f"the engine reports it sampled with {name}={record[name]!r}, the run's is {declared[name]!r} (an "
                "engine default applied to a field left out, or a proxy on the path rewrote the request)"
            )
    return None


def parse_version_spans(spans, num_tokens: int, where: str) -> list[VersionSpan]:
    """Spans from JSON (``[{"version", "start", "end"}, ...]``); they must tile ``[0, num_tokens)``."""
    if not isinstance(spans, list):
        raise WireError(f"{where}: weight_versions must be a list of spans, got {type(spans).__name__}")
    out = []
    for i, span in enumerate(spans):
        try:
            version, start, end = span["version"], span["start"], span["end"]
        except (KeyError, TypeError):
            raise WireError(
                f"{where}: weight_versions[{i}] = {span!r:.80} is not a {{version, start, end}} span"
            ) from None
        if not isinstance(start, int) or not isinstance(end, int) or isinstance(start, bool) or isinstance(end, bool):
            raise WireError(f"{where}: weight_versions[{i}]: start and end must be integers, got {start!r}, {end!r}")
        out.append(VersionSpan(str(version), start, end))
    check_version_spans(out, num_tokens, where)
    return out


def check_version_spans(spans: list[VersionSpan], num_tokens: int, where: str) -> None:
    position = 0
    for i, span in enumerate(spans):
        if span.start != position or span.end <= span.start:
            raise WireError(
                f"{where}: weight_versions[{i}] = [{span.start}, {span.end}) does not continue at position {position}"
            )
        position = span.end
    if position != num_tokens:
        raise WireError(f"{where}: weight_versions cover {position} of {num_tokens} output tokens")


def validate_completion(
    completion: Completion,
    request: GenerateRequest,
    vocab_size: int,
    index: int = 0,
    routing: RoutingShape | None = None,
) -> Completion:
    """The full rule set on one response, once, where it enters: raise ``WireError`` naming
    the completion, the token and the rule (docs/contract.md, "fail closed"). ``routing`` is the
    trainer's model's routing shape, which captured routing must fit."""
    where = f"completion {index}"
    n = completion.num_tokens
    if n == 0:
        raise WireError(f"{where}: empty response")
    bad = next(
        (t for t in completion.output_ids if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size),
        None,
    )
    if bad is not None or n != len(completion.output_ids):
        raise WireError(f"{where}: output token {bad!r:.40} is not an id in the vocabulary [0, {vocab_size})")
    ids = np.asarray(completion.output_ids, dtype=np.int64)
    if completion.weight_versions:
        check_version_spans(completion.weight_versions, n, where)
    if request.return_sampling_mask:
        if completion.support is None or completion.log_mu is None:
            raise WireError(f"{where}: capture was requested but the response carries no support")
        if completion.support.num_rows != n or len(completion.log_mu) != n:
            raise WireError(
                f"{where}: {completion.support.num_rows} support rows and {len(completion.log_mu)} log-probs for {n} "
                "tokens"
            )
        try:
            completion.support.validate(vocab_size, ids, name=where)
        except SupportError as exc:
            raise WireError(str(exc)) from exc
        lp = np.asarray(completion.log_mu, dtype=np.float64)
        bad = ~np.isfinite(lp) | (lp > 1e-5)  # a log-prob cannot be positive beyond rounding
        if bad.any():
            t = int(np.flatnonzero(bad)[0])
            raise WireError(f"{where} token {t}: log mu {lp[t]} is not a finite value <= 0")
        singleton = completion.support.sizes() == 1
        wrong = singleton & (np.abs(lp) > 1e-6)  # log(1), up to an engine's rounding
        if wrong.any():
            t = int(np.flatnonzero(wrong)[0])
            raise WireError(f"{where} token {t}: singleton support but log mu {lp[t]} != 0")
    if request.return_sampling_mask and completion.sampler is not None:  # our engine says what it sampled with
        problem = sampler_problem(completion.sampler, request)
        if problem is not None:
            raise SamplerMismatch(f"{where}: {problem}")
    if request.return_sampling_mask and request.sampling_logprobs_mode == "support":
        check_support_row_logprobs(completion, where)
    if request.return_routed_experts:
        check_routed_experts(completion, request, routing, where)
    if request.return_logprob:
        full = completion.full_logprobs
        if full is None or len(full) != n:
            raise WireError(f"{where}: full-vocabulary log-probs were requested but not returned for every token")
        if not np.all(np.isfinite(full)):
            t = int(np.flatnonzero(~np.isfinite(full))[0])
            raise WireError(f"{where} token {t}: full-vocabulary log-prob {full[t]} is not finite")
    return completion


SUPPORT_LSE_TOLERANCE = 1e-4  # |log-sum-exp of a row's log q| allowed: an engine's fp32 log-softmax over |S| ids


def check_support_row_logprobs(completion: Completion, where: str) -> None:
    """``"support"`` mode: one finite log q per support id, each row normalised (log-sum-exp 0 within
    ``SUPPORT_LSE_TOLERANCE``), the selected id's value equal to its log mu."""
    rows = completion.support_row_logprobs
    if rows is None or len(rows) != completion.num_tokens:
        n = None if rows is None else len(rows)
        raise WireError(
            f"{where}: sampling_logprobs_mode 'support' asked, {n} rows of log q for {completion.num_tokens} tokens"
        )
    support = completion.support
    sizes = support.sizes()
    counts = np.fromiter((np.size(r) for r in rows), np.int64, len(rows))
    if (counts != sizes).any():
        t = int(np.flatnonzero(counts != sizes)[0])
        raise WireError(f"{where} token {t}: {int(counts[t])} log q values for a support of {int(sizes[t])} ids")
    flat = np.concatenate([np.asarray(r, np.float64).ravel() for r in rows])  # aligned with support.ids
    starts = support.offsets[:-1]
    bad = ~np.isfinite(flat)
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        t = int(np.searchsorted(support.offsets, at, "right") - 1)
        raise WireError(f"{where} token {t}: a log q value is not finite ({flat[at]})")
    peak = np.maximum.reduceat(flat, starts)
    lse = peak + np.log(np.add.reduceat(np.exp(flat - np.repeat(peak, sizes)), starts))
    wrong = np.abs(lse) > SUPPORT_LSE_TOLERANCE
    if wrong.any():
        t = int(np.flatnonzero(wrong)[0])
        raise WireError(f"{where} token {t}: the support's log q values sum to exp({lse[t]:.3g}), not 1")
    position, _ = support.locate(np.asarray(completion.output_ids))  # the selected ids are in their rows
    off = np.abs(flat[position] - np.asarray(completion.log_mu, np.float64)) > 1e-6
    if off.any():
        t = int(np.flatnonzero(off)[0])
        raise WireError(
            f"{where} token {t}: log q of the selected id {flat[position[t]]} differs from its log mu "
            f"{completion.log_mu[t]}"
        )


def check_routed_experts(completion: Completion, request: GenerateRequest, shape: RoutingShape | None, where: str):
    """Routing for every fed position (prompt + output - 1), of the model's layers and top-k, ids in range."""
    routed = completion.routed_experts
    if routed is None:
        raise WireError(
            f"{where}: routed experts were requested but the response carries none (is the server started with "
            "--enable-return-routed-experts, and does a router on the path forward return_routed_experts?)"
        )
    prompt, n = len(request.input_ids), completion.num_tokens
    problem = routing_problem(routed, prompt + n - 1, shape)
    if problem is not None:
        raise WireError(f"{where}: {problem} ({prompt} prompt + {n} output tokens; the last output token is never fed)")
    ends = []
    for k, earlier in enumerate(completion.routed_experts_history or []):
        end = earlier.shape[0] - prompt + 1 if earlier.ndim == 3 else -1
        if not (ends[-1] if ends else 0) < end < n:
            raise WireError(
                f"{where}: routed_experts_history[{k}] covers {earlier.shape[0]} positions: not the prompt's "
                f"{prompt} with more outputs than the computation before it and fewer than the {n} of the answer"
            )
        problem = routing_problem(earlier, prompt + end - 1, shape)
        if problem is not None:
            raise WireError(f"{where}: routed_experts_history[{k}]: {problem}")
        ends.append(end)
    switches = completion.weight_versions[1:]
    unrouted = [span for span in switches if span.start not in ends]
    if unrouted:
        span = unrouted[0]
        raise WireError(
            f"{where}: output token {span.start} was sampled by version {span.version!r} after a switch of weights "
            "that routed its prefix again, and the response carries one routing of that prefix (SGLang 0.5.23 "
            "keeps the latest computation's per position): the tokens before the switch cannot be scored under "
            "the routing that sampled them. Our serve and engine keep it (routed_experts_history); with another "
            "server use --weight-sync-mode wait or abort under --use-rollout-routing-replay"
        )
