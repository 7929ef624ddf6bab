"""Experiment trackers beside metrics.jsonl: Weights & Biases (``--use-wandb``) and TensorBoard
(``--use-tensorboard``), on rank 0, every numeric field of every metrics row at its rollout as the
step, and the run's config. Both are optional dependencies (``pip install 'support-replay[trackers]'``);
a flag that asks for one that is not installed is refused by name before the run starts."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError

INSTALL = "pip install 'support-replay[trackers]'"


def scalars(row: dict) -> dict[str, float]:
    """The numeric fields of a metrics row (booleans and text left out)."""
    return {k: float(v) for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}


class Trackers:
    """What the run logs to besides its JSONL; a no-op without the flags or off rank 0."""

    def __init__(self, output, config: dict, *, enabled: bool, start: int = 0):
        self.wandb_run = self.writer = None
        if not enabled:
            return
        if output.use_wandb:
            self.wandb_run = _wandb_run(output, config)
        if output.use_tensorboard:
            self.writer = _tensorboard_writer(output, config, start)

    def log(self, row: dict) -> None:
        values, step = scalars(row), int(row.get("rollout", 0))
        if self.wandb_run is not None:
            self.wandb_run.log(values, step=step)
        if self.writer is not None:
            for key, value in values.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
        if self.writer is not None:
            self.writer.close()


def _wandb_run(output, config: dict):
    try:
        import wandb
    except ImportError:
        raise ConfigError(f"--use-wandb: the wandb package is not installed ({INSTALL})") from None
    directory = Path(output.wandb_dir or output.output_dir)
    directory.mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=output.wandb_project,
        group=output.wandb_group,
        name=output.wandb_run_name,
        mode=output.wandb_mode or os.environ.get("WANDB_MODE") or None,
        dir=str(directory),
        config=config,
        reinit="create_new",
    )


def _tensorboard_writer(output, config: dict, start: int):
    try:
        import tensorboard  # noqa: F401  (torch's writer needs it)
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError(f"--use-tensorboard: the tensorboard package is not installed ({INSTALL})") from None
    directory = Path(output.tensorboard_dir or Path(output.output_dir) / "tensorboard")
    writer = SummaryWriter(str(directory), purge_step=start or None)  # a resume drops what came after its checkpoint
    writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in config.items()), start)
    return writer
