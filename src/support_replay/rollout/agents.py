"""Agents: user code that plays an episode through a session, and the runner that turns
finished sessions into training samples (docs/agents.md).

Two signatures are accepted, told apart by their parameters:

- ours: ``async def run(client, sample) -> float``. ``client`` is an ``openai.AsyncOpenAI``
  bound to the episode's session, ``sample`` an ``Episode``; the return value is the reward.
- Miles' (the reference implementation, ``--custom-agent-function-path``):
  ``async def run_agent(base_url, prompt, request_kwargs=None, metadata=None, agent_config=None)``.
  ``base_url`` ends in ``/sessions/<id>``; the agent posts OpenAI chat requests to
  ``base_url + "/v1/chat/completions"`` and returns nothing or a metadata dict; the run's
  reward function scores the finished trajectory (the prompt, the last assistant message).
- a harness that names its own conversations (verifiers sends ``X-Session-ID``):
  ``async def run_group(base_url, prompt, n, request_kwargs=None, metadata=None, agent_config=None)``
  plays the task's ``n`` rollouts itself under ``base_url`` (``.../tasks/<task>``), one ``X-Session-ID``
  per rollout; every id is one sample of the task's GRPO group. It returns nothing (the run's reward
  function scores each conversation's last message, or ``POST base_url/finish`` with the id set a
  reward) or a mapping ``{X-Session-ID: reward}``.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from dataclasses import dataclass, field

from ..errors import ConfigError, NonFiniteError, SessionFailed, SessionNotFound
from .sample import Sample
from .session import SessionSettings, SessionStore, merge_metadata
from .user_code import load_function


@dataclass
class Episode:
    """What an agent is given: the task, and the bounds of the episode."""

    index: int
    group: int
    prompt: str | list[dict]
    label: str | None = None
    metadata: dict = field(default_factory=dict)
    max_turns: int = 8

    @property
    def messages(self) -> list[dict]:
        return list(self.prompt) if isinstance(self.prompt, list) else [{"role": "user", "content": self.prompt}]


@dataclass
class Agent:
    fn: object
    style: str  # "client" | "base_url" | "group"
    name: str
    tasks: object = None  # a built-in environment's own task source
    chat_template: str | None = None  # a built-in environment's template


def load_agent(spec: str) -> Agent:
    """``module:function`` (or ``module.function``), or the name of a built-in environment."""
    from . import environments

    if spec in environments.BUILTIN:
        env = environments.BUILTIN[spec]
        return Agent(env.run, "client", spec, tasks=env.Tasks, chat_template=env.CHAT_TEMPLATE)
    fn = load_function(spec, "--agent-path")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"--agent-path={spec!r}: the agent must be an async function")
    params = list(inspect.signature(fn).parameters)
    style = "base_url" if params[:1] == ["base_url"] or "prompt" in params else "client"
    if style == "base_url" and "n" in params:
        style = "group"
    if style == "client" and len(params) < 2:
        raise ConfigError(
            f"--agent-path={spec!r}: expected async run(client, sample) or run_agent(base_url, prompt, ...), got "
            f"({', '.join(params)})"
        )
    return Agent(fn, style, spec)


@dataclass
class EpisodeResult:
    samples: list[Sample]
    error: Exception | None = None


class AgentRunner:
    """Plays episodes through a session server in front of ``store`` (at ``base_url``)."""

    def __init__(
        self, agent: Agent, store: SessionStore, base_url: str, *, reward_fn, timeout: float, api_key: str | None = None
    ):
        self.agent, self.store, self.base_url = agent, store, base_url.rstrip("/")
        self.reward_fn, self.timeout, self.api_key = reward_fn, timeout, api_key

    async def episode(self, ep: Episode, *, seed: int, settings: SessionSettings, rollout: int) -> EpisodeResult:
        """One episode; a failed one (engine, agent error, timeout) comes back with ``error`` set
        and no samples: it never trains."""
        session = None
        try:  # a session that cannot be opened (too many open, bad metadata) fails this episode, not the rollout
            session = self.store.create(seed=seed, metadata=dict(ep.metadata), settings=settings)
            reward, meta = await asyncio.wait_for(self._play(ep, session.id, settings), self.timeout)
            return EpisodeResult(self._samples(session, ep, reward, meta, rollout))
        except NonFiniteError:
            raise
        except Exception as exc:  # the episode failed: its group is regenerated or dropped
            return EpisodeResult([], self._timeout_named(exc, f"episode {ep.index}"))
        finally:
            if session is not None:
                self.store.discard(session.id)

    async def group(
        self, ep: Episode, n: int, *, seeds: list[int], settings: SessionSettings, rollout: int
    ) -> list[EpisodeResult]:
        """A task's whole group from a harness that names its conversations: every ``X-Session-ID`` it opens
        under the task's URL is one sample, ``ep.index + k`` in order of first sight. The group fails as one
        (it is regenerated or dropped) when the harness fails or opens other than ``n`` conversations."""
        scope = self.store.clients.open_task(n, seeds, settings=settings, metadata=dict(ep.metadata))
        sessions = []
        try:
            rewards = await asyncio.wait_for(self._play_group(ep, scope.id, n, settings), self.timeout)
            sessions = self.store.clients.close_task(scope.id)
            if len(sessions) != n:
                raise SessionFailed(f"task {ep.group}: the harness played {len(sessions)} of its {n} conversations")
            out = []
            for k, session in enumerate(sessions):
                one = Episode(ep.index + k, ep.group, ep.prompt, ep.label, dict(ep.metadata), ep.max_turns)
                reward = rewards.get(session.metadata["client_session_id"], session.reward)
                out.append(EpisodeResult(self._samples(session, one, reward, {}, rollout)))
            return out
        except NonFiniteError:
            raise
        except Exception as exc:
            return [EpisodeResult([], self._timeout_named(exc, f"task {ep.group}"))] * n
        finally:
            for session in sessions or self._scope_sessions(scope.id):
                self.store.discard(session.id)

    def _scope_sessions(self, task: str) -> list:
        try:
            return self.store.clients.close_task(task)
        except SessionNotFound:
            return []

    def _samples(self, session, ep: Episode, reward, meta: dict, rollout: int) -> list[Sample]:
        """The finished session's samples with its reward (the run's reward function's where none was given)."""
        if session.failed:
            raise SessionFailed(f"session {session.id}: {session.failed}")
        if not session.trajectories():
            raise SessionFailed(f"episode {ep.index}: the agent finished without a model turn")
        merge_metadata(session, meta)
        if reward is None:  # Miles' style: the run's reward function scores the trajectory
            reward = self.reward_fn(_prompt_text(ep), session.last_assistant_text(), ep.label)
        reward = float(reward)
        if not math.isfinite(reward):
            raise NonFiniteError(
                f"rollout {rollout}, episode {ep.index}: the reward is {reward}; nothing of this rollout trains"
            )
        return session.to_samples(first_index=0, group=ep.group, reward=reward, label=ep.label, episode=ep.index)

    def _timeout_named(self, exc: Exception, what: str) -> Exception:
        return SessionFailed(f"{what}: no end after {self.timeout} s") if isinstance(exc, asyncio.TimeoutError) else exc

    async def _play_group(self, ep: Episode, task: str, n: int, settings: SessionSettings) -> dict:
        out = await self.agent.fn(**self._base_url_kwargs(ep, f"{self.base_url}/tasks/{task}", settings, n=n))
        if out is not None and not isinstance(out, dict):
            raise ConfigError(f"--agent-path={self.agent.name}: a group harness returns None or {{id: reward}}")
        return dict(out or {})

    async def _play(self, ep: Episode, sid: str, settings: SessionSettings):
        url = f"{self.base_url}/sessions/{sid}"
        if self.agent.style == "client":
            import openai

            async with openai.AsyncOpenAI(
                base_url=url + "/v1", api_key=self.api_key or "support-replay", max_retries=0, timeout=self.timeout
            ) as client:
                return await self.agent.fn(client, ep), {}
        out = await self.agent.fn(**self._base_url_kwargs(ep, url, settings))
        return None, (out if isinstance(out, dict) else {})

    def _base_url_kwargs(self, ep: Episode, url: str, settings: SessionSettings, **given) -> dict:
        """Miles-style arguments: the URL and prompt, and the optional ones the function declares."""
        params = inspect.signature(self.agent.fn).parameters
        optional = {
            "request_kwargs": {"max_tokens": settings.max_new_tokens},
            "metadata": dict(ep.metadata),
            "agent_config": ep.metadata.get("agent_config"),
        }
        return {"base_url": url, "prompt": ep.prompt, **given, **{k: v for k, v in optional.items() if k in params}}


def _prompt_text(ep: Episode) -> str:
    return ep.prompt if isinstance(ep.prompt, str) else "\n".join(str(m.get("content", "")) for m in ep.prompt)
