"""The rollout side of a run: prompts, reward, the backend that generates, evaluation.

Rank 0 talks to the engine (in-process, or over HTTP to our server, a router or SGLang)
and broadcasts the samples. Every completion was validated once by the backend, where it
entered this process; the samples built from them are trusted from here on.
"""

from __future__ import annotations

import secrets
import threading
import uuid
from dataclasses import asdict, replace

import numpy as np

from ..backends.kind import EngineKind, Needs
from ..backends.registry import kind_for
from ..core.penalties import NO_PENALTIES
from ..core.routing import RoutingShape
from ..core.sampling import SamplingParams
from ..rollout import generate_samples
from ..rollout.data import ArithmeticTask
from ..rollout.episodes import generate_episodes
from ..rollout.partial import PartialRollouts
from ..rollout.sample import Sample
from ..serving.security import LOOPBACK_HOSTS, Keys
from .checks import version_ages
from .config import RunConfig
from .dist import on_main
from .rollout_plan import RolloutPlan

REGENERATION_SEED_STRIDE = 1_000_003  # a stale group generated again draws with other seeds than the first time


class Rollouts:
    """``kind``: the engine kind that generates (``backends/registry.py``); rank 0 connects it. ``plan``: what
    the rollout side reads of the run's config (``rollout_plan.py``)."""

    def __init__(self, ctx, tokenizer, kind: EngineKind, needs: Needs, plan: RolloutPlan):
        self.ctx, self.tokenizer, self.kind, self.plan = ctx, tokenizer, kind, plan
        self.prompts, self.eval_prompts = plan.prompts.train, plan.prompts.held_out
        self.engine = self.backend = None
        self.run_id = uuid.uuid4().hex[:12]  # request ids of this run: {run}/{rollout}/{sample}/{attempt}
        self.agent = self.sessions = None  # agents: set up on rank 0, which generates
        self._lock = threading.Lock()  # one generation at a time: an evaluation waits for a rollout in flight
        # --partial-rollout: the groups kept from one rollout for the next (rank 0)
        self.partial = (
            PartialRollouts(
                plan.rollout_batch_size,
                plan.over_sampling,
                max_kept_capture_ids=plan.max_kept_capture_ids,
                max_lag=plan.max_policy_lag,
            )
            if plan.over_sampling
            else None
        )
        self.penalty_semantics = on_main(lambda: self._penalty_semantics(needs.vocab_size), ctx)
        if not ctx.is_main:
            return
        self.backend = kind.connect(needs)
        self.engine = kind.engine  # the in-process engine, or None
        if plan.agents.agent or plan.agents.agent_path:
            self._start_sessions(tokenizer)

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        ctx,
        checkpoint_path,
        tokenizer,
        vocab_size: int,
        weight_version: str,
        routing_shape: RoutingShape | None = None,
    ):
        """The rollout side of a run: what it reads of the config, and its engine kind (on rank 0)."""
        from ..engine.kv_budget import COLOCATED_SHARE

        needs = cfg.engine_needs(vocab_size, weight_version, routing_shape, kv_share=COLOCATED_SHARE)
        kind = kind_for(cfg.engine, cfg.in_process_engine(checkpoint_path))  # connected on rank 0 only
        return cls(ctx, tokenizer, kind, needs, RolloutPlan.from_config(cfg))

    @property
    def engine_name(self) -> str:
        """Where samples come from, for messages."""
        return self.kind.where

    def _penalty_semantics(self, vocab_size: int) -> str:
        """Whose penalty rules the trainer replays: the engine's that samples. Our engine says
        its semantics; SGLang and vLLM are accepted at the versions whose code was read
        (docs/math.md), or the run fails closed naming the engine and the setting."""
        penalties = self.plan.asked.penalties
        semantics = self.kind.penalty_semantics(penalties, self.plan.sampling_semantics)
        penalties.check(semantics, vocab_size, where=f"{self.engine_name} penalties")
        return semantics

    def _start_sessions(self, tokenizer) -> None:
        """Agents: a session store over the backend, served on loopback for the agents' OpenAI clients."""
        from ..rollout.agents import AgentRunner, load_agent
        from ..rollout.chat import ChatRenderer, load_template
        from ..rollout.session import SessionSettings, SessionStore
        from ..serving.sessions import create_sessions_app
        from ..serving.threaded import ThreadedServer

        agents, asked, seed = self.plan.agents, self.plan.asked, self.plan.prompt_seed
        self.agent = load_agent(agents.agent or agents.agent_path)
        if self.agent.tasks is not None:  # a built-in environment brings its tasks
            self.prompts, self.eval_prompts = self.agent.tasks(seed), self.agent.tasks(seed + 1)
        template = load_template(agents.chat_template or self.agent.chat_template)
        self.session_settings = SessionSettings(
            asked.params,
            capture=asked.capture,
            max_turns=agents.max_turns,
            max_episode_tokens=agents.max_episode_tokens,
            max_new_tokens=asked.max_new_tokens,
            history_policy=agents.session_history_policy,
            penalties=asked.penalties,
            routing=asked.routing,
            support_logprobs=asked.support_logprobs,
        )
        self.sessions = SessionStore(self.backend, ChatRenderer(tokenizer, template), self.session_settings)
        # loopback names only (no DNS rebinding from a browser), a key of this run's own for everything but a
        # session's URL: the agents are handed session URLs (the session id, 128 random bits, is their key)
        app = create_sessions_app(
            self.sessions, keys=Keys(api=secrets.token_hex(16)), allowed_hosts=LOOPBACK_HOSTS, session_urls_open=True
        )
        self.session_server = ThreadedServer(app).start()
        self.runner = AgentRunner(
            self.agent,
            self.sessions,
            self.session_server.url,
            reward_fn=self.plan.prompts.reward_fn,
            timeout=agents.agent_timeout,
        )

    def _produce(self, prompts, params, n, max_new, capture, rollout, seed, tag) -> tuple[list[Sample], dict]:
        """Rank 0: the samples and what failed. No collective here: with --async-rollout it runs
        on a background thread, one generation at a time (evaluation waits for the rollout)."""
        plan, on_failure = self.plan, self.plan.on_failure
        asked = replace(
            plan.asked,
            params=params,
            n_samples=n,
            max_new_tokens=max_new,
            capture=capture,
            penalties=plan.asked.penalties if capture else NO_PENALTIES,
            ignore_eos=plan.asked.ignore_eos and tag != "eval",  # eval answers end at EOS
            routing=capture and plan.asked.routing,
            support_logprobs=capture and plan.asked.support_logprobs,
        )
        with self._lock:
            if self.agent is not None:
                settings = replace(
                    self.session_settings,
                    params=params,
                    capture=capture,
                    max_new_tokens=max_new,
                    penalties=asked.penalties,
                    routing=asked.routing,
                    support_logprobs=asked.support_logprobs,
                )
                samples, stats = generate_episodes(
                    self.runner,
                    prompts,
                    n_samples=n,
                    settings=settings,
                    rollout=rollout,
                    seed=seed,
                    failed_group_policy=on_failure.policy,
                    max_regenerations=on_failure.max_regenerations,
                )
            else:
                samples, stats = generate_samples(
                    self.backend,
                    self.tokenizer,
                    prompts,
                    asked,
                    reward_fn=plan.prompts.reward_fn,
                    rollout=rollout,
                    seed=seed,
                    rid_prefix=f"{self.run_id}/{tag}",
                    on_failure=on_failure,
                )
        return samples, asdict(stats)

    def rollout_prompts(self, r: int) -> list:
        size = self.plan.rollout_batch_size
        return [self.prompts[r * size + i] for i in range(size)]

    def _train_samples(self, prompts: list, seed: int, tag: str, r: int) -> tuple[list[Sample], dict]:
        """A training rollout's request (the plan's ``asked``) for ``prompts``."""
        asked = self.plan.asked
        return self._produce(prompts, asked.params, asked.n_samples, asked.max_new_tokens, asked.capture, r, seed, tag)

    def produce(self, r: int, pushed: list[str] | None = None) -> tuple[list[Sample], dict]:
        """Rank 0: rollout ``r``, ``n_samples_per_prompt`` responses to each of its prompts,
        rewarded, and what failed on the way. ``pushed``: the versions pushed so far (the current one last), where
        they are final for this rollout (not --async-rollout)."""
        if self.partial is not None:
            return self._partial(r, pushed)
        samples, stats = self._train_samples(self.rollout_prompts(r), self.plan.rollout_seed, "train", r)
        return self.whole_batches(samples, stats)

    def _partial(self, r: int, pushed: list[str] | None) -> tuple[list[Sample], dict]:
        """--partial-rollout: the first ``rollout_batch_size`` groups to finish of those sent (rollout/partial.py)."""
        with self._lock:
            samples, stats = self.partial.generate(
                self.backend,
                self.tokenizer,
                self.prompts,
                self.plan.asked,
                reward_fn=self.plan.prompts.reward_fn,
                rollout=r,
                seed=self.plan.rollout_seed,
                rid_prefix=f"{self.run_id}/train",
                ages=version_ages(pushed) if pushed else None,
            )
        return samples, asdict(stats)

    def regenerate(self, r: int, prompts: list[int], round_: int) -> tuple[list[Sample], dict]:
        """Rank 0: the groups of rollout ``r``'s ``prompts`` (indices) generated again, with fresh
        seeds and request ids; ``metadata["prompt"]`` keeps the index in the rollout."""
        every = self.rollout_prompts(r)
        seed = self.plan.rollout_seed + REGENERATION_SEED_STRIDE * round_
        samples, stats = self._train_samples([every[g] for g in prompts], seed, f"train-again{round_}", r)
        for s in samples:
            s.metadata["prompt"] = prompts[s.metadata["prompt"]]
        return samples, stats

    def whole_batches(self, samples: list[Sample], stats: dict) -> tuple[list[Sample], dict]:
        """Dropped groups can break the global batch: whole groups go from the end until it is
        whole (agent runs plan a short last step instead)."""
        whole = len(samples) - len(samples) % self.plan.global_batch_size
        if whole < len(samples) and not self.plan.agents.enabled:
            stats["dropped_groups"] += (len(samples) - whole) // self.plan.asked.n_samples
            samples = samples[:whole]
        return samples, stats

    def evaluate_if_due(self, r: int) -> dict:
        """``evaluate`` after every ``--eval-interval``-th rollout, else nothing."""
        every = self.plan.evaluation.eval_interval
        return self.evaluate(r) if every and (r + 1) % every == 0 else {}

    def evaluate(self, r: int) -> dict:
        """Mean reward on held-out prompts, capture off (greedy unless --eval-temperature); every rank gets it."""
        return on_main(lambda: self._evaluate(r), self.ctx)

    def _evaluate(self, r: int) -> dict:
        task, evaluation = self.eval_prompts, self.plan.evaluation
        offset = 10**6 if isinstance(task, ArithmeticTask) else 0  # held-out questions
        prompts = [task[offset + i] for i in range(min(evaluation.n_eval_prompts, len(task)))]
        params = (
            SamplingParams(
                temperature=evaluation.eval_temperature, top_k=evaluation.eval_top_k, top_p=evaluation.eval_top_p
            )
            if evaluation.eval_temperature > 0
            else SamplingParams(temperature=0.0)
        )
        samples, _ = self._produce(
            prompts,
            params,
            evaluation.n_samples_per_eval_prompt,
            evaluation.eval_max_response_len or self.plan.asked.max_new_tokens,
            False,
            r,
            self.plan.rollout_seed + 7,
            "eval",
        )
        return {
            "eval_reward_mean": float(np.mean([s.reward for s in samples])),
            "eval_response_len": float(np.mean([s.response_length for s in samples])),
        }

    def release_engine_memory(self) -> None:
        """Between a synchronous rollout and the update: the in-process engine lets go of what it
        keeps between generations (its packed weights, stale once the new weights are pushed)."""
        if self.engine is not None:
            self.engine.release_packed_weights()

    def close(self) -> None:
        if self.sessions is not None:
            self.session_server.stop()
            self.sessions.close()
        self.kind.close()
