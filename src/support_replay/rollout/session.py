"""Sessions: multi-turn chat over any backend, recorded token in, token out (docs/agents.md).

A session keeps the exact token ids of its trajectory. A turn renders the client's messages
with the chat template only to find what is new: the text after what the session's tokens
already spell. That text (tool results, user and environment messages, template glue, the
generation prompt) is tokenized alone and inserted with loss mask 0; earlier tokens are never
re-tokenized. The model's output is appended with its captured support and log mu.

Three checks guard a turn. The client's messages must extend the recorded ones unchanged (an
edited or dropped turn is a history rewrite); the template must render the recorded messages
as a prefix of the new rendering (templates that rewrite earlier turns, e.g. strip earlier
reasoning, fail this); and that rendering must begin with exactly the text of the session's
tokens (a template that renders a model turn differently from what the model generated fails
this). On a failed check the session either starts a new sample at that turn
(``history_policy="split"``) or refuses the turn (``"reject"``), and says which check and where.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

from ..core.penalties import NO_PENALTIES, Penalties
from ..core.sampling import SamplingParams
from ..errors import (
    EngineError,
    EngineUnavailable,
    HistoryMismatch,
    RequestError,
    SessionBusy,
    SessionFailed,
    SessionNotFound,
    SessionsFull,
    WireError,
)
from ..protocol import Completion, GenerateRequest
from .chat import ChatRenderer, normalize_message, parse_tool_calls
from .client_sessions import ClientSessions
from .sample import Sample
from .trajectory import Trajectory

HISTORY_POLICIES = ("split", "reject")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p")


@dataclass(frozen=True)
class SessionSettings:
    """What every session of a store samples with (the run's rollout settings) and its bounds."""

    params: SamplingParams
    capture: bool = True
    max_turns: int = 8
    max_episode_tokens: int = 1024  # response tokens of a sample (model and inserted)
    max_new_tokens: int = 256  # per turn, when the client gives no max_tokens
    history_policy: Literal["split", "reject"] = "split"
    ttl: float = 900.0  # seconds a session may stay unused before it is dropped
    penalties: Penalties = NO_PENALTIES  # the run's; each turn is one engine request, its output history its own
    routing: bool = False  # capture every turn's expert routing (routing replay on a MoE model)
    support_logprobs: bool = False  # the sampler's log q of every support id of every turn (score centering)

    def __post_init__(self):
        if self.history_policy not in HISTORY_POLICIES:
            raise RequestError(f"history_policy: one of {HISTORY_POLICIES}, got {self.history_policy!r}")
        for name in ("max_turns", "max_episode_tokens", "max_new_tokens"):
            if getattr(self, name) < 1:
                raise RequestError(f"{name}: must be >= 1, got {getattr(self, name)}")


MAX_METADATA_BYTES = 64 * 1024  # a session's metadata, as JSON: it rides along with every sample of the episode


def merge_metadata(session: Session, metadata: dict | None) -> None:
    """``metadata`` merged into ``session``'s, refused (400, nothing merged) when the result would pass
    ``MAX_METADATA_BYTES`` as JSON or is not JSON (every ``/finish`` merges: without a bound a client grows
    it forever)."""
    if not metadata:
        return
    merged = {**session.metadata, **metadata}
    try:
        size = len(json.dumps(merged, default=str))
    except (TypeError, ValueError) as exc:
        raise RequestError(f"session {session.id}: metadata is not JSON: {exc}") from exc
    if size > MAX_METADATA_BYTES:
        raise RequestError(
            f"session {session.id}: metadata of {size} bytes as JSON exceeds the limit of {MAX_METADATA_BYTES}"
        )
    session.metadata.clear()
    session.metadata.update(merged)


@dataclass
class ChatTurn:
    """One chat request to a session, as parsed by the HTTP layer (or built by a caller)."""

    messages: list[dict]
    tools: list[dict] | None = None
    max_tokens: int | None = None
    seed: int | None = None
    sampling: dict = field(default_factory=dict)  # sampling fields the client set explicitly
    logprobs: bool = False
    parse_tools: bool = True  # tool_choice "none": tools are shown, calls are not parsed
    top_logprobs: int = 0
    grammar: str | None = None  # structured outputs: response_format or a forced tool call (engine/grammar.py)


@dataclass
class TokenTurn:
    """One token-level request to a session (vLLM's /inference/v1/generate), as parsed by the HTTP layer."""

    token_ids: list[int]
    max_tokens: int | None = None
    seed: int | None = None
    sampling: dict = field(default_factory=dict)  # sampling fields the client set explicitly
    logprobs: bool = False
    top_logprobs: int = 0
    stop_token_ids: list[int] = field(default_factory=list)
    skip_special_tokens: bool = True


@dataclass
class TurnResult:
    content: str
    tool_calls: list[dict]
    finish_reason: str  # OpenAI's: stop | length | tool_calls
    completion: Completion | None  # None when the episode's turn or token budget was spent
    prompt_tokens: int
    split: str | None = None  # why this turn started a new sample


@dataclass
class _Plan:
    input_ids: list[int]
    inserted: list[int]
    new_prompt: tuple[str, list[int]] | None  # a new sample starts here: (text, ids)
    split: str | None = None


class Session:
    def __init__(
        self, sid: str, settings: SessionSettings, renderer: ChatRenderer, seed: int, metadata: dict | None = None
    ):
        self.id, self.settings, self.renderer, self.seed = sid, settings, renderer, seed
        self.metadata = dict(metadata or {})
        self.segments: list[Trajectory] = []  # finished samples of this episode (after splits)
        self.current: Trajectory | None = None
        self.messages: list[dict] = []  # normalized, as recorded: the last one is the model's
        self.tools: list[dict] | None = None
        self.turns = 0
        self.splits: list[dict] = []
        self.failed: str | None = None
        self.finished = False
        self.reward: float | None = None
        self.last_used = time.monotonic()
        self._busy = False
        self._last: tuple[list, object] | None = None  # the last turn's input and answer (a retry gets it again)
        self.kind: str | None = None  # "chat" or "tokens": what its turns are, fixed by the first
        # the X-Session-ID that names it (client_sessions.py); such a session never splits: a history other than
        # its own is another conversation under a known or guessed id, not an edit of this one (409)
        self.client_id: str | None = None

    # ---- one turn -------------------------------------------------------------------

    async def chat(self, turn: ChatTurn, generate) -> TurnResult:
        """Run one turn; ``generate`` is ``async (GenerateRequest) -> Completion``."""
        return await self._one_at_a_time("chat", lambda: self._chat(turn, generate))

    async def tokens(self, turn: TokenTurn, generate) -> tuple[GenerateRequest | None, Completion | None]:
        """Run one token-level turn (vLLM's /inference/v1/generate): ``(the engine request, its completion)``,
        both None when the episode's turn or token budget was spent."""
        return await self._one_at_a_time("tokens", lambda: self._tokens(turn, generate))

    async def _one_at_a_time(self, kind: str, run):
        if self._busy:
            raise SessionBusy(f"session {self.id}: a turn is still running; send one request at a time")
        if self.finished or self.failed:
            raise RequestError(
                f"session {self.id}: the session is {'finished' if self.finished else 'failed'}; no more turns"
            )
        if self.kind not in (None, kind):
            raise RequestError(
                f"session {self.id}: a {self.kind} session takes no {kind} turn (chat messages or token ids, one "
                "kind per session)"
            )
        self._busy = True
        try:
            return await run()
        finally:
            self._busy = False
            self.last_used = time.monotonic()

    async def _tokens(self, turn: TokenTurn, generate):
        ids = list(turn.token_ids)
        if self._last is not None and ids == self._last[0]:
            return self._last[1]  # a retry: the same answer, once
        self._check_sampling(turn.sampling)
        plan = self._token_plan(ids)
        used = (0 if plan.new_prompt else self.current.response_length) + len(plan.inserted)
        budget = self.settings.max_episode_tokens - used
        if self.turns >= self.settings.max_turns or budget < 1:
            return None, None
        extra = {"stop_token_ids": list(turn.stop_token_ids), "skip_special_tokens": turn.skip_special_tokens}
        request = self._request(plan, turn.max_tokens, budget, turn.seed, turn.logprobs, turn.top_logprobs, **extra)
        completion = await self._generate(request, generate)
        self._commit(plan, None, completion)
        self.kind = "tokens"
        self._last = (ids, (request, completion))
        return request, completion

    def _token_plan(self, ids: list[int]) -> _Plan:
        """The new token ids extend the recorded trajectory (the extension is inserted), or a new sample starts."""
        fresh = _Plan(ids, [], (self.renderer.decode(ids), ids))
        if self.current is None:
            return fresh
        recorded = self.current.ids
        if len(ids) > len(recorded) and ids[: len(recorded)] == recorded:
            return _Plan(ids, ids[len(recorded) :], None)
        at = next((i for i, (a, b) in enumerate(zip(ids, recorded)) if a != b), min(len(ids), len(recorded)))
        why = (
            f"history check: token_ids ({len(ids)}) do not extend the {len(recorded)} recorded tokens (they differ "
            f"at position {at})"
        )
        self._refuse_split(why)
        fresh.split = f"turn {self.turns}: {why}"
        return fresh

    async def _chat(self, turn: ChatTurn, generate) -> TurnResult:
        messages = [normalize_message(m, i) for i, m in enumerate(turn.messages)]
        if self._last is not None and messages == self._last[0]:
            return self._last[1]  # the client sent the same turn again (a retry): the same answer, once
        self._check_sampling(turn.sampling)
        tools = turn.tools or None
        plan = self._plan(messages, tools)
        used = (0 if plan.new_prompt else self.current.response_length) + len(plan.inserted)
        budget = self.settings.max_episode_tokens - used
        if self.turns >= self.settings.max_turns or budget < 1:
            # the episode ends here; the trajectory stays as it is, valid
            return TurnResult("", [], "length", None, len(plan.input_ids), plan.split)
        request = self._request(
            plan, turn.max_tokens, budget, turn.seed, turn.logprobs, turn.top_logprobs, grammar=turn.grammar
        )
        completion = await self._generate(request, generate)
        self._commit(plan, tools, completion)
        result = self._answer(
            messages, tools if turn.parse_tools else None, completion, len(plan.input_ids), plan.split
        )
        self._last = (messages, result)
        self.kind = "chat"
        return result

    def _request(self, plan: _Plan, max_tokens, budget: int, seed, logprobs: bool, top: int, **extra):
        """The turn's engine request: the run's settings, the session's seed for this turn unless given."""
        mask = self.settings.capture or (logprobs and self.settings.params.replay_active)
        return GenerateRequest(
            input_ids=plan.input_ids,
            params=SamplingParams(
                **{f: getattr(self.settings.params, f) for f in SAMPLING_FIELDS},
                seed=seed if seed is not None else session_turn_seed(self.seed, self.turns),
            ),
            max_new_tokens=min(max_tokens or self.settings.max_new_tokens, budget),
            return_sampling_mask=mask,
            return_logprob=logprobs and not mask,  # unfiltered, uncaptured: the full distribution's log-probs
            top_logprobs=0 if mask else top,
            sampling_logprobs_mode="support" if top or self.settings.support_logprobs else "selected",
            rid=f"{self.id}/{self.turns}",
            routing_key=self.id,
            penalties=self.settings.penalties,
            return_routed_experts=self.settings.routing,
            **extra,
        )

    async def _generate(self, request: GenerateRequest, generate) -> Completion:
        try:
            return await generate(request)
        except RequestError:
            raise
        except (EngineError, WireError) as exc:  # down, overloaded, aborted, or a malformed answer
            self.failed = f"turn {self.turns}: {exc}"
            raise SessionFailed(
                f"session {self.id}, turn {self.turns}: the engine failed the turn; the episode ends ({exc})"
            ) from exc

    def _check_sampling(self, given: dict) -> None:
        params = self.settings.params
        run = {**{f: getattr(params, f) for f in SAMPLING_FIELDS}, **self.settings.penalties.to_json()}
        for name, value in given.items():
            if name in run and value is not None and value != run[name]:
                raise RequestError(
                    f"session {self.id}: {name}={value!r} differs from the run's rollout setting {run[name]!r}; "
                    "the trainer replays the run's settings, so a session samples with those only"
                )

    def _plan(self, messages: list[dict], tools) -> _Plan:
        if self.current is None:
            return self._fresh(messages, tools, None)
        why = self._history_difference(messages, tools)
        if why is None:
            before = self.renderer.render(self.messages, tools, generation_prompt=False)
            after = self.renderer.render(messages, tools, generation_prompt=True)
            spelled = self.renderer.decode(self.current.ids)
            if not after.startswith(before):
                at = _first_difference(before, after)
                why = (
                    "template check: the chat template renders the recorded turns differently once the new messages "
                    "are "
                    f"added (at character {at}: {before[at : at + 40]!r} becomes {after[at : at + 40]!r}); it "
                    "rewrites earlier turns"
                )
            elif not before.startswith(spelled):
                at = _first_difference(spelled, before)
                why = (
                    f"template check: the chat template renders a recorded turn differently from the tokens the model "
                    f"generated (at character {at}: the tokens spell {spelled[at : at + 40]!r}, the template "
                    f"{before[at : at + 40]!r})"
                )
            else:
                inserted = self.renderer.encode(after[len(spelled) :])
                return _Plan(self.current.ids + inserted, inserted, None)
        self._refuse_split(why)
        return self._fresh(messages, tools, f"turn {self.turns}: {why}")

    def _refuse_split(self, why: str) -> None:
        if self.client_id is not None:
            raise HistoryMismatch(
                f"X-Session-ID {self.client_id!r:.80}, turn {self.turns}: {why}; the turn is refused (a conversation "
                "named by the client never splits: send a new X-Session-ID for a new conversation)"
            )
        if self.settings.history_policy == "reject":
            raise HistoryMismatch(
                f"session {self.id}, turn {self.turns}: {why}; the turn is refused (history_policy=reject)"
            )

    def _fresh(self, messages, tools, split: str | None) -> _Plan:
        text = self.renderer.render(messages, tools, generation_prompt=True)
        ids = self.renderer.encode(text)
        return _Plan(ids, [], (text, ids), split)

    def _history_difference(self, messages: list[dict], tools) -> str | None:
        recorded = self.messages
        if tools != self.tools:
            return "history check: the tools changed (they render into the system prompt)"
        for i, (given, kept) in enumerate(zip(messages, recorded)):
            if given != kept:
                return f"history check: messages[{i}] ({kept['role']}) differs from what the session recorded"
        if len(messages) < len(recorded):
            return f"history check: the request has {len(messages)} messages, the session recorded {len(recorded)}"
        if len(messages) == len(recorded):
            return "history check: no new message after the model's last turn"
        return None

    def _commit(self, plan: _Plan, tools, completion: Completion) -> None:
        if plan.new_prompt is not None:
            if self.current is not None:
                self.segments.append(self.current)
            if plan.split:
                self.splits.append({"turn": self.turns, "why": plan.split})
            text, ids = plan.new_prompt
            self.current = Trajectory(list(ids), text, capture=self.settings.capture, penalties=self.settings.penalties)
        self.current.append_turn(plan.inserted, completion)
        self.tools = tools
        self.turns += 1

    def _answer(self, messages, tools, completion: Completion, prompt_tokens: int, split) -> TurnResult:
        ids = completion.output_ids
        if completion.finish_reason.get("type") == "stop" and completion.finish_reason.get("matched") == ids[-1]:
            ids = ids[:-1]  # the stop token ends the turn; the template writes it back
        text = self.renderer.decode(ids)
        content, calls = parse_tool_calls(text) if tools else (text, [])
        reply = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
        self.messages = messages + [normalize_message(reply, len(messages))]
        finish = "tool_calls" if calls else ("length" if completion.finish_reason.get("type") == "length" else "stop")
        return TurnResult(content, calls, finish, completion, prompt_tokens, split)

    # ---- the end of an episode --------------------------------------------------------

    def trajectories(self) -> list[Trajectory]:
        return self.segments + ([self.current] if self.current is not None else [])

    def last_assistant_text(self) -> str:
        if self.kind == "tokens" and self.current is not None:  # the model's last output, as text
            ids = self.current.response_ids[self.current.output_starts[-1] :]
            return self.renderer.tokenizer.decode(ids, skip_special_tokens=True)
        return next((m.get("content", "") for m in reversed(self.messages) if m["role"] == "assistant"), "")

    def to_samples(
        self, *, first_index: int, group: int, reward: float, label=None, episode: int | None = None
    ) -> list[Sample]:
        """One sample per segment (one in all unless the history was split), every one with the
        episode's reward; the segments of one episode share ``metadata["episode"]``."""
        meta = {
            **self.metadata,
            "session": self.id,
            "turns": self.turns,
            "splits": list(self.splits),
            "final_message": self.last_assistant_text(),
        }
        if episode is not None:
            meta["episode"] = episode
        out = []
        for k, traj in enumerate(self.trajectories()):
            text = self.renderer.decode(traj.response_ids)
            out.append(
                traj.to_sample(
                    first_index + k,
                    group,
                    reward=reward,
                    temperature=self.settings.params.temperature,
                    label=label,
                    response_text=text,
                    metadata={**meta, "segment": k},
                )
            )
        return out


def session_turn_seed(session_seed: int, turn: int) -> int:
    return (session_seed * 1_000_003 + turn * 7_919 + 1) % (2**62)


def _first_difference(a: str, b: str) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class SessionStore:
    """Every session of one process, in front of one backend. Thread-safe: the HTTP server's
    loop and the trainer's agent loop use it at once."""

    def __init__(
        self,
        backend,
        renderer: ChatRenderer,
        settings: SessionSettings,
        *,
        max_sessions: int = 4096,
        max_sessions_per_caller: int = 1024,
        workers: int = 256,
    ):
        self.backend, self.renderer, self.settings = backend, renderer, settings
        self.max_sessions = max_sessions
        self.max_sessions_per_caller = max_sessions_per_caller  # client-named sessions of one API key
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.clients = ClientSessions(self)  # sessions keyed by the client's X-Session-ID, task scopes
        # a thread per waiting turn: the backends block; the engine batches what arrives together
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="session-turn")

    def create(
        self, *, seed: int | None = None, metadata: dict | None = None, settings: SessionSettings | None = None
    ) -> Session:
        """A new session; ``settings`` other than the store's (evaluation: capture off, greedy)."""
        self.expire()
        with self._lock:
            if len(self._sessions) >= self.max_sessions:
                raise SessionsFull(
                    f"sessions: {self.max_sessions} are open; finished, deleted and expired ones make room"
                )
            sid = uuid.uuid4().hex
            seed = seed if seed is not None else int.from_bytes(uuid.uuid4().bytes[:7], "little")
            session = Session(sid, settings or self.settings, self.renderer, seed, {})
            merge_metadata(session, metadata)
            self._sessions[sid] = session
        return session

    def get(self, sid: str) -> Session:
        """The session ``sid``; one unused for longer than the ttl is dropped here, not only at the next sweep."""
        with self._lock:
            session = self._sessions.get(sid)
            if session is not None and self._expired(session, time.monotonic()):
                del self._sessions[sid]
                session = None
        if session is None:
            raise SessionNotFound(f"session {sid!r:.80}: no such session (never made, deleted, or expired)")
        return session

    def _expired(self, session: Session, now: float) -> bool:
        return not session._busy and now - session.last_used > session.settings.ttl

    def delete(self, sid: str) -> Session:
        with self._lock:
            session = self._sessions.pop(sid, None)
        if session is None:
            raise SessionNotFound(f"session {sid!r:.80}: no such session (never made, deleted, or expired)")
        return session

    def discard(self, sid: str) -> None:
        with self._lock:
            self._sessions.pop(sid, None)

    def finish(self, sid: str, reward: float | None = None, metadata: dict | None = None) -> Session:
        session = self.get(sid)
        merge_metadata(session, metadata)
        session.finished, session.reward = True, reward
        return session

    def expire(self) -> int:
        """Drop sessions unused for longer than the ttl; how many went."""
        now = time.monotonic()
        with self._lock:
            old = [sid for sid, s in self._sessions.items() if self._expired(s, now)]
            for sid in old:
                del self._sessions[sid]
        return len(old)

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, sid: str) -> bool:
        with self._lock:
            return sid in self._sessions

    async def chat(self, sid: str, turn: ChatTurn, on_token=None, cancelled=None) -> TurnResult:
        """One turn; ``on_token(request, id)`` (on a worker thread) as each token is sampled, when given;
        ``cancelled`` (an ``Event``, a ``backends.Cancellation`` best) drops the turn at the engine."""
        return await self.get(sid).chat(turn, self._generator(on_token, cancelled))

    async def tokens(self, sid: str, turn: TokenTurn, cancelled=None):
        return await self.get(sid).tokens(turn, self._generator(None, cancelled))

    def _generator(self, on_token, cancelled):
        if on_token is None and cancelled is None:
            return self.generate
        if on_token is None:  # a whole answer, through the stream where one is: a client leaving drops the turn
            return lambda request: self.generate_cancellable(request, cancelled)
        return lambda request: self.generate_streaming(request, on_token, cancelled)

    async def generate_cancellable(self, request: GenerateRequest, cancelled) -> Completion:
        """``generate``, dropped at the engine when ``cancelled`` is set, where the backend streams (ours, SGLang;
        vLLM's backend streams nothing: its turn runs to its end). A stream that fails before its answer, the
        client still there, is tried again the retrying way (nothing went out to the client yet)."""
        if getattr(self.backend, "generate_streaming", None) is None:
            return await self.generate(request)
        try:
            return await self.generate_streaming(request, lambda *_: None, cancelled)
        except EngineUnavailable:
            if cancelled.is_set():
                raise asyncio.CancelledError from None
            return await self.generate(request)

    async def generate(self, request: GenerateRequest) -> Completion:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: self.backend.generate([request])[0])

    async def generate_streaming(self, request: GenerateRequest, on_token, cancelled=None) -> Completion:
        """``generate``, the tokens handed to ``on_token`` as the engine samples them (our engine in process, or
        SGLang's streamed /generate: our serve and router, SGLang); a backend that streams nothing (vLLM's)
        hands them over once the answer is whole."""
        stream = getattr(self.backend, "generate_streaming", None)
        if stream is None:
            completion = await self.generate(request)
            for token in completion.output_ids:
                on_token(request, token)
            return completion
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._pool, lambda: stream(request, lambda token: on_token(request, token), cancelled)
            )
        except (EngineError, WireError):
            if cancelled is not None and cancelled.is_set():  # the client went away: the turn is dropped, not failed
                raise asyncio.CancelledError from None
            raise

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
