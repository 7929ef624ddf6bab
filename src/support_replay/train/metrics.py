"""Run metrics: one JSON line per rollout, a console progress bar, a plot at the end."""

from __future__ import annotations

import json
from pathlib import Path


class MetricsLog:
    def __init__(self, directory: Path, total: int, start: int = 0, progress: bool = True, enabled: bool = True):
        self.path = Path(directory) / "metrics.jsonl"
        self.enabled = enabled
        self.rows: list[dict] = []
        self.bar = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if start == 0 and self.path.exists():
                self.path.unlink()
            elif self.path.exists():  # resume: keep what came before the checkpoint
                kept = [json.loads(line) for line in self.path.read_text().splitlines() if line.strip()]
                self.rows = [r for r in kept if r.get("rollout", 0) < start]
                self.path.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
            if progress:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, desc="rollouts", unit="step", dynamic_ncols=True)

    def log(self, row: dict) -> None:
        if not self.enabled:
            return
        self.rows.append(row)
        with self.path.open("a") as f:
            f.write(json.dumps(row) + "\n")
        line = (
            f"step {row['rollout']}: reward {row['reward_mean']:.3f}  |S| {row.get('support_mean', float('nan')):.1f}  "
            f"max|dlogp| {row.get('train_rollout_logprob_abs_diff_max', float('nan')):.2e}  loss {row.get('loss', float('nan')):.4f}  "
            f"time {row.get('time_step', 0):.1f}s"
        )
        if self.bar is not None:
            self.bar.update(1)
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> Path | None:
        if self.bar is not None:
            self.bar.close()
        if not self.enabled or not self.rows:
            return None
        return plot(self.rows, self.path.with_name("metrics.png"))


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["rollout"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [r["reward_mean"] for r in rows], marker="o")
    a.set_xlabel("rollout")
    a.set_ylabel("mean reward")
    a.set_title("reward")
    b.semilogy(steps, [max(r.get("train_rollout_logprob_abs_diff_max", 0.0), 1e-12) for r in rows], marker="o", label="max")
    b.semilogy(steps, [max(r.get("train_rollout_logprob_abs_diff_mean", 0.0), 1e-12) for r in rows], marker="s", label="mean")
    b.set_xlabel("rollout")
    b.set_ylabel("|log pi - log mu|")
    b.set_title("trainer vs rollout log-prob (before the update)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
