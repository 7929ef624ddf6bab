"""Run metrics: what a rollout looked like, one JSON line per rollout, a console progress bar,
a plot at the end."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..core.losses import logprob_mismatch_metrics, support_size_metrics
from ..rollout.sample import Sample


def rollout_metrics(
    samples: list[Sample], old_logp: list[torch.Tensor], old_full: list[torch.Tensor] | None, replay: bool
) -> dict:
    """Reward, lengths, and under replay: support sizes, bytes on the wire, and the ratio
    pi/mu the trainer saw before its update, on the support and (what a full-vocabulary
    scorer would have seen) on the full vocabulary."""
    out = {
        "samples": len(samples),
        "reward_mean": float(np.mean([s.reward for s in samples])),
        "response_len_mean": float(np.mean([s.response_length for s in samples])),
        "truncated_share": float(np.mean([s.status == "truncated" for s in samples])),
    }
    if any("turns" in s.metadata for s in samples):  # agent episodes
        out.update(agent_metrics(samples))
    out.update(routing_metrics(samples))
    if not replay:
        return out
    # over the tokens the model sampled: inserted ones are singletons with a ratio of exactly 1
    model = np.concatenate([s.loss_mask for s in samples]).astype(bool)
    out.update(support_size_metrics(np.concatenate([s.support.sizes() for s in samples])[model]))
    tokens = sum(s.response_length for s in samples)
    received = sum(s.support_bytes for s in samples)
    if received:  # 0 in-process: nothing crossed a wire
        out["support_bytes_per_token"] = received / tokens
    log_mu = torch.cat([torch.from_numpy(s.log_mu) for s in samples])[None]
    mask = torch.from_numpy(model.astype(np.float32))[None]
    if old_full is not None:
        full = logprob_mismatch_metrics(torch.cat(old_full).cpu()[None], log_mu, mask)
        out["full_vocab_ratio_mean"] = full["ratio_mean"]
        out["full_vocab_ratio_outside_10pct"] = full["ratio_outside_10pct"]
    replayed = logprob_mismatch_metrics(torch.cat(old_logp).cpu()[None], log_mu, mask)
    out["replay_ratio_mean"] = replayed["ratio_mean"]
    out["mismatch_kl"] = replayed["mismatch_kl"]
    return out


def routing_metrics(samples: list[Sample]) -> dict:
    """What the routing cost on the wire per routed position, how often a decoded token's experts changed when a
    later turn's prefill computed it again (sessions), and how many earlier computations the trainer scores in rows
    of their own; empty without captured routing."""
    routed = [s for s in samples if s.routing is not None]
    if not routed:
        return {}
    out = {}
    received = sum(s.routing_bytes for s in routed)
    if received:
        out["routing_bytes_per_token"] = received / sum(len(s.routing) for s in routed)
    differ, compared = (sum(s.routing_recomputed[i] for s in routed) for i in (0, 1))
    if compared:
        out["routing_recomputed_flip_share"] = differ / compared
    # earlier computations that routed a prefix otherwise (a push's recompute, a continued or later turn): each
    # scored in a row of its own, so that every token is scored under the routing that computed it
    out["routing_history_rows"] = sum(len(s.routing_history) for s in routed)
    return out


def agent_metrics(samples: list[Sample]) -> dict:
    """Turns per episode, the share of response tokens the model did not sample, splits."""
    firsts = [s for s in samples if s.metadata.get("segment", 0) == 0]
    tokens = sum(s.response_length for s in samples)
    return {
        "episode_turns_mean": float(np.mean([s.metadata.get("turns", 1) for s in firsts])),
        "inserted_token_share": float(sum(int((s.loss_mask == 0).sum()) for s in samples) / max(tokens, 1)),
        "split_samples": len(samples) - len(firsts),
    }


def read_rows(path: Path) -> list[dict]:
    """The rows of a metrics file; a torn last line (the run died while writing it) is dropped."""
    lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
    rows = []
    for n, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if n == len(lines) - 1:
                break
            raise
    return rows


# why a rollout's groups were dropped, besides failed responses: (metric, what it counts)
SKIP_REASONS = (
    ("dropped_groups", "groups dropped (--failed-group-policy, or a short global batch)"),
    ("stale_groups_dropped", "groups older than --max-policy-lag"),
    ("lag_dropped_groups", "groups with a sample older than --max-policy-lag"),
)


class MetricsLog:
    def __init__(
        self, directory: Path, total: int, start: int = 0, progress: bool = True, enabled: bool = True, trackers=None
    ):
        self.path = Path(directory) / "metrics.jsonl"
        self.enabled = enabled
        self.trackers = trackers  # W&B / TensorBoard beside the JSONL (train/trackers.py), or None
        self.rows: list[dict] = []
        self.bar = None
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if start == 0 and self.path.exists():
                self.path.unlink()
            elif self.path.exists():  # resume: keep what came before the checkpoint
                self.rows = [r for r in read_rows(self.path) if r.get("rollout", 0) < start]
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
        if self.trackers is not None:
            self.trackers.log(row)
        if row.get("skipped"):
            why = [f"{row.get('failed_samples', 0)} responses failed"]
            why += [f"{row[k]} {what}" for k, what in SKIP_REASONS if row.get(k)]
            print(f"step {row['rollout']}: skipped, every group dropped ({', '.join(why)})", flush=True)
            return
        line = (
            f"step {row['rollout']}: reward {row['reward_mean']:.3f}  |S| {row.get('support_mean', float('nan')):.1f}  "
            f"max|dlogp| {row.get('train_rollout_logprob_abs_diff_max', float('nan')):.2e}  loss "
            f"{row.get('loss', float('nan')):.4f}  "
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
        if self.trackers is not None:
            self.trackers.close()
        if not self.enabled or not self.rows:
            return None
        return plot(self.rows, self.path.with_name("metrics.png"))


def plot(rows: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if not r.get("skipped")]
    steps = [r["rollout"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(steps, [r["reward_mean"] for r in rows], marker="o")
    a.set_xlabel("rollout")
    a.set_ylabel("mean reward")
    a.set_title("reward")
    b.semilogy(
        steps, [max(r.get("train_rollout_logprob_abs_diff_max", 0.0), 1e-12) for r in rows], marker="o", label="max"
    )
    b.semilogy(
        steps, [max(r.get("train_rollout_logprob_abs_diff_mean", 0.0), 1e-12) for r in rows], marker="s", label="mean"
    )
    b.set_xlabel("rollout")
    b.set_ylabel("|log pi - log mu|")
    b.set_title("trainer vs rollout log-prob (before the update)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class Timings(dict):
    """``with clock("update"): ...`` records ``time_update``; ``time_step`` runs from construction."""

    def __init__(self):
        super().__init__()
        self._start = time.perf_counter()

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self[f"time_{name}"] = time.perf_counter() - start

    def total(self) -> dict:
        return {**self, "time_step": time.perf_counter() - self._start}
