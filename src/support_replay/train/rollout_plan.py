"""What the rollout side reads of a run's config, as one record: the request a training rollout sends, what
a failed group gets, the prompts and their reward, the rollout's sizes and seeds, evaluation and agents."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..rollout import load_prompts, load_reward
from ..rollout.generate import Asked, OnFailure
from .config import RunConfig
from .sections import AgentConfig, DataConfig, EvalConfig


@dataclass(frozen=True)
class Prompts:
    """The training prompts, the held-out ones (with ``--eval-interval``) and the reward of an answer."""

    train: object
    held_out: object | None
    reward_fn: Callable

    @classmethod
    def load(cls, data: DataConfig, evaluation: EvalConfig, seed: int) -> Prompts:
        keys = dict(max_operand=data.max_operand)
        train = load_prompts(data.prompt_data, data.input_key, data.label_key, seed=seed, **keys)
        held_out = None
        if evaluation.eval_interval:  # held out by their seed
            held_out = load_prompts(evaluation.eval_prompt_data, data.input_key, data.label_key, seed=seed + 1, **keys)
        return cls(train, held_out, load_reward(data.rm_type, data.custom_rm_path))


@dataclass(frozen=True)
class RolloutPlan:
    """``asked``: a training request (the run's sampling, samples per prompt, length, capture, the run's
    penalties, EOS, routing and support log q, chat template); ``prompt_seed`` orders the prompts and a built-in
    agent's tasks; ``sampling_semantics`` is whose penalty rules the run declares."""

    asked: Asked
    on_failure: OnFailure
    prompts: Prompts
    rollout_batch_size: int
    global_batch_size: int
    rollout_seed: int
    prompt_seed: int
    sampling_semantics: str
    agents: AgentConfig
    evaluation: EvalConfig
    over_sampling: int | None = None  # --partial-rollout: groups a rollout sends (None: partial rollouts off)
    max_kept_capture_ids: int = (
        1 << 26
    )  # --partial-rollout: the kept groups' support ids, at most (then no over-sampling)
    max_policy_lag: int = 0  # --partial-rollout: a kept group at this lag is not stopped again; one past it is dropped

    @classmethod
    def from_config(cls, cfg: RunConfig) -> RolloutPlan:
        rollout, production, seed = cfg.rollout, cfg.production, cfg.optimizer.seed
        asked = Asked(
            rollout.sampling_params,  # built once, with the config (its range rules are its own)
            n_samples=rollout.n_samples_per_prompt,
            max_new_tokens=rollout.rollout_max_response_len,
            capture=rollout.use_sampling_support_replay,
            penalties=rollout.penalties,
            ignore_eos=rollout.rollout_ignore_eos,
            routing=cfg.replay.use_rollout_routing_replay,  # every position's experts (MoE)
            support_logprobs=cfg.optimizer.use_score_centering,  # the sampler's log q of every support id
            apply_chat_template=cfg.data.apply_chat_template,
        )
        return cls(
            asked,
            OnFailure(production.failed_group_policy, production.max_regenerations),
            Prompts.load(cfg.data, cfg.evaluation, seed),
            rollout.rollout_batch_size,
            cfg.parallel.global_batch_size,
            rollout.rollout_seed,
            seed,
            rollout.sampling_semantics,
            cfg.agents,
            cfg.evaluation,
            (production.over_sampling_batch_size or rollout.rollout_batch_size) if production.partial_rollout else None,
            production.max_kept_capture_ids,
            production.max_policy_lag,
        )
