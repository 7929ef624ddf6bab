"""Run configs and the parts of a run, for the trainer's tests (one process, no process group)."""

import torch
from transformers import AutoTokenizer

from support_replay.train.config import RunConfig
from support_replay.train.dist import DistContext
from support_replay.train.learner import Learner
from support_replay.train.rollouts import Rollouts

ONE_RANK = DistContext(rank=0, world=1, device=torch.device("cpu"), owns_group=False)


def run_config(checkpoint, tmp_path, **overrides) -> RunConfig:
    values = dict(
        hf_checkpoint=str(checkpoint),
        num_rollout=3,
        rollout_batch_size=2,
        n_samples_per_prompt=4,
        global_batch_size=4,
        micro_batch_size=2,
        rollout_max_response_len=10,
        lr=1e-3,
        custom_rm_path="rewards_for_tests:digit_share",
        output_dir=str(tmp_path / "out"),
        progress=False,
        ci_test=True,
        rollout_top_p=0.8,
        rollout_top_k=32,
    )
    values.update(overrides)
    return RunConfig(**values)


def agent_config(checkpoint, tmp_path, **overrides) -> RunConfig:
    values = dict(
        hf_checkpoint=str(checkpoint),
        num_rollout=2,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        global_batch_size=4,
        rollout_max_response_len=10,
        max_turns=3,
        max_episode_tokens=256,
        lr=1e-3,
        output_dir=str(tmp_path / "out"),
        progress=False,
        ci_test=True,
        rollout_top_p=0.8,
        rollout_top_k=32,
    )
    values.update(overrides)
    return RunConfig(**values)


def parts(checkpoint, cfg):
    """The learner and the rollout side of a run, without the loop (one process, no process group)."""
    learner = Learner.from_config(cfg, ONE_RANK, checkpoint)
    rollouts = Rollouts.from_config(
        cfg, ONE_RANK, checkpoint, AutoTokenizer.from_pretrained(checkpoint), learner.vocab_size, "0"
    )
    return learner, rollouts
