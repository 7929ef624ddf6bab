"""The exception types of support-replay, all in one place.

Every rejection (bad support metadata, malformed wire bytes, unsupported sampling
settings, a bad request, a bad run setting) raises a subclass of ``SupportReplayError``
whose message names the field, the sample or row, and the offending value.
"""

from __future__ import annotations


class SupportReplayError(ValueError):
    """Base class: input that the replay contract cannot accept."""


# ---- the core ---------------------------------------------------------------------


class SupportError(SupportReplayError):
    """A support table violates an invariant (empty row, duplicate id, id out of range...)."""


class WireError(SupportReplayError):
    """Encoded support bytes or an engine payload are malformed or incomplete."""


class SamplerMismatch(WireError):
    """The engine reports it sampled with settings other than the run's (its sampler record)."""


class EngineUnavailable(WireError):
    """No answer from the engine after the retries: it is down, overloaded (503) or broke (5xx),
    or it aborted the request. The response never trains; its GRPO group is regenerated or
    dropped (``--failed-group-policy``)."""


class EngineOverloaded(EngineUnavailable):
    """Every try found the engine's queue full (503): nothing of the request ran, so its group is
    generated again with the same seeds (rollout/generate.py)."""


class SamplingParamsError(SupportReplayError):
    """Sampling settings that are invalid, or that replay cannot reproduce faithfully."""


# ---- the engine and its server ------------------------------------------------------


class EngineError(SupportReplayError):
    """A request the engine cannot serve; ``status`` is the HTTP status it maps to."""

    status = 500


class RequestError(EngineError):
    """Malformed or unsupported request (HTTP 400)."""

    status = 400


class CapacityError(RequestError):
    """The realized support exceeded ``sampling_mask_max_tokens`` (HTTP 400, nothing committed)."""


class OverloadedError(EngineError):
    """The admission queue is full (HTTP 503); ``retry_after`` says when to try again, in seconds."""

    status = 503
    retry_after = 1

    @classmethod
    def queue_full(cls, max_queue: int) -> OverloadedError:
        return cls(f"the admission queue is full ({max_queue} waiting); retry later")


class SessionsFull(OverloadedError):
    """The session table is full (HTTP 503, ``Retry-After``): finished, deleted and expired sessions make room."""

    retry_after = 5


class SessionQuota(OverloadedError):
    """This caller (its API key) holds its share of the session table (HTTP 429, ``Retry-After``)."""

    status = 429
    retry_after = 5


class RequestConflict(EngineError):
    """A request id already names another request (another prompt or other settings) (HTTP 409)."""

    status = 409


class AbortedError(EngineError):
    """The request was cancelled (its client went away) before it finished."""

    status = 499


# ---- sessions (multi-turn, agents) ---------------------------------------------------


class SessionNotFound(EngineError):
    """No session with that id (never made, deleted, or expired) (HTTP 404)."""

    status = 404


class SessionBusy(EngineError):
    """A turn of this session is still running: a session is one linear trajectory (HTTP 409)."""

    status = 409


class HistoryMismatch(EngineError):
    """The client's messages no longer extend what the session recorded, and the session
    rejects such turns (``history_policy="reject"``) (HTTP 409)."""

    status = 409


class SessionFailed(EngineError):
    """The engine of this session failed a turn; the episode ends and never trains (HTTP 502)."""

    status = 502


# ---- training -----------------------------------------------------------------------


class ConfigError(SupportReplayError):
    """A run setting that is invalid or that replay cannot honour faithfully."""


class SampleError(SupportReplayError):
    """A training sample whose replay metadata is missing or inconsistent; the message names it."""


class CITestError(SupportReplayError):
    """--ci-test found a token whose trainer log-prob differs from the rollout log mu."""


class NonFiniteError(SupportReplayError):
    """A reward, a loss or a gradient is NaN or infinite; the run stops before anything is pushed or saved."""


class PolicyLagError(SupportReplayError):
    """A sample's tokens were sampled by weights older than --max-policy-lag allows, or unknown ones."""
