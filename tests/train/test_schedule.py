"""Learning-rate schedules: torch's schedulers follow Megatron's formula step by step, the recipe's metrics
report the learning rate each update ran at, and a resume continues the schedule exactly."""

import pytest
import torch

from recipe_helpers import run_config
from support_replay.errors import ConfigError
from support_replay.train import train
from support_replay.train.config import RunConfig
from support_replay.train.schedule import lr_scheduler, scheduled_lr


@pytest.mark.parametrize("style", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 2, 5])
def test_the_scheduler_is_megatron_s_schedule(style, warmup):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([p], lr=3e-4)
    scheduler = lr_scheduler(opt, lr=3e-4, warmup=warmup, decay_style=style, decay_end=12, min_lr=3e-5)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        scheduler.step()
    want = [scheduled_lr(s, lr=3e-4, warmup=warmup, decay_style=style, decay_end=12, min_lr=3e-5) for s in range(20)]
    assert seen == pytest.approx(want, rel=1e-12, abs=1e-18)
    if style != "constant":
        assert seen[11:] == pytest.approx([3e-5] * 9)  # min_lr from iteration 12 on, never back up
    if warmup >= 2:
        assert seen[0] == pytest.approx(3e-4 / warmup) and seen[warmup - 1] == pytest.approx(3e-4)


SCHEDULE = dict(lr=1e-3, lr_warmup_iters=2, lr_decay_style="cosine", min_lr=1e-4, num_rollout=5)


def test_the_metrics_report_each_update_s_learning_rate_and_a_resume_continues_it(tiny_checkpoint, tmp_path):
    whole = train(run_config(tiny_checkpoint, tmp_path / "whole", **SCHEDULE))
    # two optimizer steps a rollout (8 samples, global batch 4): each row reports its last step's rate
    assert all(r["optimizer_steps"] == 2 for r in whole)
    want = [
        scheduled_lr(2 * r + 1, lr=1e-3, warmup=2, decay_style="cosine", decay_end=10, min_lr=1e-4) for r in range(5)
    ]
    assert [r["lr"] for r in whole] == pytest.approx(want, rel=1e-12)
    assert all(r["train_rollout_logprob_abs_diff_max"] <= 1e-3 for r in whole)
    # a run of 3 rollouts with the same schedule (its decay end given), then resumed to 5
    saved = dict(save=str(tmp_path / "ckpt"), save_interval=3, lr_decay_iters=10)
    train(run_config(tiny_checkpoint, tmp_path / "first", **{**SCHEDULE, "num_rollout": 3}, **saved))
    resumed = train(run_config(tiny_checkpoint, tmp_path / "first", **SCHEDULE, resume=True, **saved))
    assert [r["rollout"] for r in resumed][-2:] == [3, 4]
    assert [r["lr"] for r in resumed][-2:] == pytest.approx(want[3:], rel=1e-12)
    # another schedule than the checkpoint's is refused by name
    with pytest.raises(ConfigError, match="saved with the learning-rate schedule"):
        train(run_config(tiny_checkpoint, tmp_path / "first", **{**SCHEDULE, "min_lr": 2e-4}, resume=True, **saved))


def test_a_fraction_of_the_run_warms_up(tiny_checkpoint, tmp_path):
    rows = train(run_config(tiny_checkpoint, tmp_path, lr=1e-3, lr_warmup_fraction=0.3, num_rollout=4))
    # 8 optimizer steps, 2 of warmup (floor of 2.4): the rows' last steps 1, 3, 5, 7 run at lr
    assert [r["lr"] for r in rows] == pytest.approx([1e-3] * 4)
    rows = train(run_config(tiny_checkpoint, tmp_path / "half", lr=1e-3, lr_warmup_fraction=0.5, num_rollout=4))
    assert [r["lr"] for r in rows] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])  # 4 warmup steps: 2/4, then 4/4


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(lr_warmup_iters=2, lr_warmup_fraction=0.1), "--lr-warmup-fraction=0.1: and --lr-warmup-iters=2"),
        (dict(lr_decay_style="cosine", min_lr=1.0), "--min-lr=1.0: is above --lr"),
        (dict(min_lr=1e-6), "--min-lr=1e-06: has no effect with --lr-decay-style constant"),
        (dict(lr_decay_style="linear", lr_warmup_iters=4, lr_decay_iters=3), "--lr-decay-iters=3: must be after"),
    ],
)
def test_schedule_settings_that_cannot_hold_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**values)
