"""The audit's figures, its certificate and the files it writes (docs/audit.md, "report").

Per token the log-ratio log pi_full - log mu is split into truncation, penalties and numerics
(``core/mismatch_parts.py``); each cause's share is its part of the summed absolute parts. The
scorings table says how far each way of scoring the actor is from log mu; the certificate passes
when the trainer's own scoring is within both thresholds and nothing was found.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

from ..core.losses import logprob_mismatch_metrics, support_size_metrics

REPORT_VERSION = 1
CAUSES = ("truncation", "penalties", "numerics")
WORST_TOKENS = 10


def causes(scores, replay: bool) -> dict[str, np.ndarray]:
    """Per-token parts of log pi_full - log mu: truncation and penalties at the audit's full logits; numerics
    the trainer's own ratio score against log mu under replay (else the audit's support score against it).
    What remains (``head_residual``: the trainer's head against the full head on the same hidden states,
    rounding) is reported beside them, not as a cause."""
    return {
        "truncation": scores.full - scores.support,
        "penalties": scores.support - scores.penalised,
        "numerics": (scores.trainer if replay else scores.penalised) - scores.log_mu,
    }


def head_residual(scores, replay: bool) -> dict:
    """How far the trainer's ratio score is from the audit's own on the same support (or vocabulary)."""
    gap = scores.trainer - (scores.penalised if replay else scores.full)
    return {"max_abs": float(np.abs(gap).max()), "mean_abs": float(np.abs(gap).mean())}


def cause_figures(parts: dict[str, np.ndarray], total: np.ndarray) -> dict:
    """Mean, mean and max absolute value of the whole log-ratio and of each part, and each part's share."""
    absolute = {k: float(np.abs(v).sum()) for k, v in parts.items()}
    whole = sum(absolute.values())
    out = {
        "total": {
            "mean": float(total.mean()),
            "mean_abs": float(np.abs(total).mean()),
            "max_abs": float(np.abs(total).max()),
        }
    }
    for k, v in parts.items():
        out[k] = {
            "mean": float(v.mean()),
            "mean_abs": float(np.abs(v).mean()),
            "max_abs": float(np.abs(v).max()),
            "share": absolute[k] / whole if whole else 0.0,
        }
    return out


def _mismatch(score: np.ndarray, log_mu: np.ndarray) -> dict:
    one = torch.ones(1, len(score))
    return logprob_mismatch_metrics(torch.from_numpy(score)[None], torch.from_numpy(log_mu)[None], one)


def scorings(scores, replay: bool, penalties: bool, max_kl: float, max_abs: float) -> dict:
    """Each way of scoring the actor against log mu, and whether it would pass; ``trainer`` is the run's."""
    table = {"full_vocabulary": scores.full, "support_replay": scores.support}
    if penalties:
        table["support_replay_with_penalties"] = scores.trainer if replay else scores.penalised
    table["trainer"] = scores.trainer
    out = {}
    for name, score in table.items():
        m = _mismatch(score, scores.log_mu)
        m["pass"] = m["mismatch_kl"] <= max_kl and m["abs_diff_max"] <= max_abs
        out[name] = m
    return out


def worst_tokens(scores, parts: dict[str, np.ndarray], key: str) -> list[dict]:
    values = scores.full - scores.log_mu if key == "total" else parts[key]
    order = np.argsort(-np.abs(values), kind="stable")[:WORST_TOKENS]
    return [
        {
            "sample": int(scores.sample[i]),
            "position": int(scores.position[i]),
            "token": int(scores.token[i]),
            "support_size": int(scores.support_size[i]),
            "log_mu": float(scores.log_mu[i]),
            **{k: float(v[i]) for k, v in parts.items()},
        }
        for i in order
    ]


def support_figures(scores) -> dict:
    return {k: float(v) for k, v in support_size_metrics(scores.support_size).items()}


def verdict(report: dict) -> tuple[bool, list[str]]:
    """Pass, and the reasons it does not."""
    why = []
    trainer = report["scorings"]["trainer"]
    limits = report["thresholds"]
    if trainer["mismatch_kl"] > limits["max_mismatch_kl"]:
        why.append(f"mismatch KL {trainer['mismatch_kl']:.3g} > --max-mismatch-kl {limits['max_mismatch_kl']:g}")
    if trainer["abs_diff_max"] > limits["max_abs_logprob_diff"]:
        why.append(
            f"max |log pi - log mu| {trainer['abs_diff_max']:.3g} > --max-abs-logprob-diff "
            f"{limits['max_abs_logprob_diff']:g}"
        )
    why += [f"{f['setting']}: {f['evidence']}" for f in report["findings"]]
    return not why, why


def write_json(report: dict, directory) -> Path:
    """``audit.json`` under ``directory``, written whole or not at all."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "audit.json"
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)
    return path


def write(report: dict, parts: dict[str, np.ndarray], directory) -> tuple[Path, Path]:
    """``audit.json`` and ``audit.png`` (the histogram of ``parts``, the whole log-ratio among them) under
    ``directory``."""
    return write_json(report, directory), plot(parts, Path(directory) / "audit.png")


def plot(parts: dict[str, np.ndarray], path: Path) -> Path:
    """Histogram of the per-token log-ratio parts, one colour per cause (symmetric log x axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    largest = max(float(np.abs(v).max()) for v in parts.values())
    edge = max(largest, 1e-6) * 1.05
    bins = np.linspace(-edge, edge, 81)
    for name, values in parts.items():
        ax.hist(values, bins=bins, histtype="step", label=name, linewidth=1.4)
    ax.set_yscale("log")
    ax.set_xlabel("per-token log(pi_full / mu) and its parts")
    ax.set_ylabel("tokens")
    ax.legend()
    ax.set_title("support-replay audit: training-inference log-ratio by cause")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def read(path) -> dict:
    """A report written by ``write``, checked for the version this code reads."""
    from ..errors import ConfigError

    report = json.loads(Path(path).read_text())
    if report.get("report_version") != REPORT_VERSION:
        raise ConfigError(f"{path}: report_version {report.get('report_version')!r}, this code reads {REPORT_VERSION}")
    return report
