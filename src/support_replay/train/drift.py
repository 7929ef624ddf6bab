"""Support drift: how much of the current policy's probability still falls inside each replayed support.

A support S_t was realized by the behaviour policy; the trainer scores the ratio renormalised
on it. When the policy that trains has moved (a policy lag, or simply several optimizer steps),
part of its mass may lie outside S_t, which the support-renormalised ratio cannot see. Per
token that mass is ``Z_S / Z_V`` under the current logits (``losses.support_mass``), read off
the two scores the trainer takes before its update anyway. Reported every rollout the
full-vocabulary head runs; ``--min-support-mass`` turns it into a gate on stale samples.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch

from ..core.losses import support_mass
from ..rollout.sample import Sample


def sample_masses(samples: list[Sample], logp: list[torch.Tensor], full: list[torch.Tensor]) -> list[np.ndarray]:
    """Per sample, the support mass of each token the model sampled (inserted tokens have none)."""
    out = []
    for s, lp, f in zip(samples, logp, full):
        mass = support_mass(f.detach().double().cpu(), lp.detach().double().cpu()).numpy()
        out.append(mass[np.asarray(s.loss_mask, bool)])
    return out


def drift_metrics(masses: list[np.ndarray], ages: list[int | None], lags: list[np.ndarray] | None = None) -> dict:
    """Token means over all samples and over the stale ones (lag >= 1), and the smallest mass; with each model
    token's lag (``lags``, aligned with ``masses``), ``support_mass_lag{k}_mean``: the drift per token lag."""
    flat = np.concatenate(masses) if masses else np.zeros(0)
    if not flat.size:
        return {}
    out = {"support_mass_mean": float(flat.mean()), "support_mass_min": float(flat.min())}
    stale = [m for m, a in zip(masses, ages) if a]
    if stale and np.concatenate(stale).size:
        out["support_mass_stale_mean"] = float(np.concatenate(stale).mean())
    if lags is not None:
        by = np.concatenate(lags)
        for k in np.unique(by):
            out[f"support_mass_lag{int(k)}_mean"] = float(flat[by == k].mean())
    return out


def gate_stale(
    samples: list[Sample], masses: list[np.ndarray], ages: list[int | None], threshold: float
) -> tuple[list[Sample], int]:
    """Samples with lag >= 1 whose mean support mass is below ``threshold`` leave the loss (their
    loss mask zeroed; they still count in the group's advantages); returns them and how many."""
    gated, out = 0, []
    for s, m, a in zip(samples, masses, ages):
        if a and m.size and float(m.mean()) < threshold:
            out.append(replace(s, loss_mask=np.zeros_like(s.loss_mask)))
            gated += 1
        else:
            out.append(s)
    return out, gated


def support_drift(
    samples: list[Sample], logp, full, ages: list[int | None], replay: bool, min_mass: float = 0.0
) -> tuple[dict, list[Sample]]:
    """The drift metrics of a rollout and the samples that train (the gate applied when
    ``min_mass`` > 0): nothing to measure without replay, without the full-vocabulary scores of
    this rollout, or with penalties (the support was filtered on penalised logits)."""
    if not replay or logp is None or full is None or samples[0].penalties.active:
        return {}, samples
    masses = sample_masses(samples, logp, full)
    lags = None
    if all("token_lags" in s.metadata for s in samples):  # train/checks.token_lags, per model token as the masses
        lags = [s.metadata["token_lags"][np.asarray(s.loss_mask, bool)] for s in samples]
    metrics = drift_metrics(masses, ages, lags)
    if min_mass <= 0:
        return metrics, samples
    trained, metrics["drift_gated_samples"] = gate_stale(samples, masses, ages, min_mass)
    return metrics, trained if metrics["drift_gated_samples"] else samples
