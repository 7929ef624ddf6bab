"""Run configs and the parts of a run, for the trainer's tests (one process, no process group)."""

import torch
from transformers import AutoTokenizer

from support_replay.train.config import RunConfig
from support_replay.train.dist import DistContext
from support_replay.train.learner import Learner
from support_replay.train.rollouts import Rollouts

ONE_RANK = DistContext(rank=0, world=1, device=torch.device("cpu"), owns_group=False)


# what every test run shares: the tiny model, a short run, replay and --ci-test on
COMMON = dict(
    num_rollout=3, rollout_batch_size=2, global_batch_size=4, rollout_max_response_len=10, lr=1e-3,
    progress=False, ci_test=True, rollout_top_p=0.8, rollout_top_k=32,
)  # fmt: skip


def run_config(checkpoint, tmp_path, **overrides) -> RunConfig:
    """A single-turn GRPO run of groups of 4, rewarded by the share of digits."""
    values = dict(
        COMMON,
        hf_checkpoint=str(checkpoint),
        output_dir=str(tmp_path / "out"),
        n_samples_per_prompt=4,
        micro_batch_size=2,
        custom_rm_path="rewards_for_tests:digit_share",
    )
    return RunConfig(**{**values, **overrides})


def agent_config(checkpoint, tmp_path, **overrides) -> RunConfig:
    """An agent run of groups of 2, episodes of up to 3 turns and 256 tokens."""
    values = dict(
        COMMON,
        hf_checkpoint=str(checkpoint),
        output_dir=str(tmp_path / "out"),
        num_rollout=2,
        n_samples_per_prompt=2,
        max_turns=3,
        max_episode_tokens=256,
    )
    return RunConfig(**{**values, **overrides})


def parts(checkpoint, cfg):
    """The learner and the rollout side of a run, without the loop (one process, no process group)."""
    learner = Learner.from_config(cfg, ONE_RANK, checkpoint)
    rollouts = Rollouts.from_config(
        cfg, ONE_RANK, checkpoint, AutoTokenizer.from_pretrained(checkpoint), learner.vocab_size, "0"
    )
    return learner, rollouts
