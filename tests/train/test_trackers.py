"""Experiment trackers: a W&B offline run and TensorBoard event files, read back by their own readers,
hold the scalars of metrics.jsonl at each rollout; a tracker that is not installed is refused by name."""

import json
import sys

import pytest

from recipe_helpers import run_config
from support_replay.errors import ConfigError
from support_replay.train import train
from support_replay.train.config import RunConfig
from support_replay.train.trackers import scalars


def wandb_records(path) -> tuple[dict[int, dict], dict]:
    """``({step: {key: value}}, config)`` of a W&B offline transaction log: the framing is LevelDB's log format (32 KiB
    blocks of records with a 7-byte header, after W&B's 7-byte file header); each record is parsed by the
    SDK's own protobuf class."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, history, config = 7, 32768, b"", {}, {}
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # the block's tail is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        pending, pos = pending + data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: a whole record
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                history[record.history.step.num] = items
            elif kind == "run":  # the run's start: its config
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
    return history, config


def test_wandb_offline_and_tensorboard_hold_the_metrics(tiny_checkpoint, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = run_config(
        tiny_checkpoint,
        tmp_path,
        num_rollout=2,
        use_wandb=True,
        wandb_mode="offline",
        wandb_group="tests",
        wandb_run_name="tiny",
        use_tensorboard=True,
    )
    rows = train(cfg)
    out = tmp_path / "out"
    # W&B: one offline run under --output-dir, every numeric metric at its rollout, the config with it
    (log,) = list(out.glob("wandb/offline-run-*/run-*.wandb"))
    history, config = wandb_records(log)
    assert config["lr"] == cfg.optimizer.lr and config["rollout_top_k"] == 32 and config["use_wandb"] is True
    for row in rows:
        logged = history[row["rollout"]]
        for key, value in scalars(row).items():
            assert logged[key] == pytest.approx(value, rel=1e-12), key
    # TensorBoard: the event files under OUTPUT_DIR/tensorboard, read by its EventAccumulator
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    for key in ("reward_mean", "loss", "lr", "train_rollout_logprob_abs_diff_max"):
        seen = [(e.step, e.value) for e in events.Scalars(key)]
        assert seen == [(r["rollout"], pytest.approx(r[key], rel=1e-6, abs=1e-12)) for r in rows], key
    assert "config/text_summary" in events.Tags()["tensors"]  # the run's config, as text


def test_a_tracker_that_is_not_installed_is_refused_by_name(tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    with pytest.raises(ConfigError, match="--use-wandb: the wandb package is not installed"):
        train(run_config(tiny_checkpoint, tmp_path, num_rollout=1, use_wandb=True, wandb_mode="offline"))


@pytest.mark.parametrize(
    "values, message",
    [
        (dict(wandb_project="p"), "--wandb-project='p': has no effect without --use-wandb"),
        (dict(tensorboard_dir="tb"), "--tensorboard-dir='tb': has no effect without --use-tensorboard"),
    ],
)
def test_tracker_settings_without_their_tracker_are_refused(values, message):
    with pytest.raises(ConfigError, match=message):
        RunConfig(**values)
