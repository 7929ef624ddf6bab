"""Checks of a rollout before it trains.

- ``check_policy_lag``: every token was sampled by weights the trainer pushed, at most
  ``--max-policy-lag`` pushes ago.
- ``compare_with_rollout`` (``--ci-test``): the trainer's log-prob of every token against the
  log mu the engine recorded, on the scores of the ratio's own path, before the rollout's
  first optimizer step. In true-on-policy mode the tolerance is 0: one token that differs in
  its last bit fails the run.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CITestError, PolicyLagError
from ..protocol import beyond_lag, versions_of
from ..rollout.sample import Sample
from .dist import on_main
from .drift import support_drift


def version_ages(pushed: list[str]) -> dict[str, int]:
    """How many pushes old each version is (``pushed``: in push order, the current one last)."""
    return {version: len(pushed) - 1 - i for i, version in enumerate(pushed)}


LAG_MASKED = "lag_masked"  # Sample.metadata: the version spans [start, end) masked for their age (partial rollouts)


def live_spans(sample: Sample) -> list:
    """The sample's version spans less those masked for their age: what trains and what --ci-test compares."""
    masked = {tuple(span) for span in sample.metadata.get(LAG_MASKED, ())}
    return [s for s in sample.weight_versions if (s.start, s.end) not in masked]


def mask_beyond_lag(samples: list[Sample], ages: dict[str, int], max_lag: int) -> tuple[list[Sample], dict]:
    """Partial rollouts: the tokens sampled more than ``max_lag`` pushes ago, masked (loss mask 0: never trained,
    never compared) rather than generated again: they stay the context the later tokens were sampled after. A group
    with a sample whose every token is masked is dropped. Returns the samples left and the counts."""
    masked_tokens, dropped = 0, set()
    for s in samples:
        old = [span for span in s.weight_versions if beyond_lag(span, ages, max_lag)]
        if not old:
            continue
        s.metadata[LAG_MASKED] = [(span.start, span.end) for span in old]
        for span in old:
            masked_tokens += int(s.loss_mask[span.start : span.end].sum())
            s.loss_mask[span.start : span.end] = 0
        if not s.loss_mask.any():
            dropped.add(s.metadata["prompt"])
    left = [s for s in samples if s.metadata["prompt"] not in dropped]
    counts = {"lag_masked_tokens": masked_tokens, "lag_dropped_samples": len(samples) - len(left)}
    return left, {**counts, "lag_dropped_groups": len(dropped)}


def sample_age(sample: Sample, ages: dict[str, int]) -> int | None:
    """The age of a sample's oldest unmasked token; None when a version is missing or was never pushed."""
    versions = versions_of(live_spans(sample))
    if not versions or any(v not in ages for v in versions):
        return None
    return max(ages[v] for v in versions)


def check_policy_lag(
    rollout: int, samples: list[Sample], pushed: list[str], max_lag: int, engine: str
) -> tuple[dict, list[int]]:
    """Raise ``PolicyLagError`` naming the engine, the sample and the versions when a token was
    sampled by weights older than ``max_lag`` pushes (``pushed``: the versions in push order,
    the current one last) or by weights the trainer never pushed; returns the lag metrics and
    every sample's age."""
    ages = version_ages(pushed)
    lags = []
    for s in samples:
        versions = versions_of(live_spans(s))
        if not versions:
            raise PolicyLagError(
                f"rollout {rollout}, sample {s.index}: {engine} reported no weight version, so the policy that "
                "sampled it is unknown (vLLM's /v1/completions reports none unless /weight_info is mounted)"
            )
        age = sample_age(s, ages)
        if age is None or age > max_lag:
            unknown = [v for v in versions if v not in ages]
            raise PolicyLagError(
                f"rollout {rollout}, sample {s.index}: {engine} sampled it with weights {versions}, but the trainer "
                f"pushed {pushed[-1]!r} last and --max-policy-lag={max_lag} allows "
                f"{pushed[max(0, len(pushed) - 1 - max_lag) :]}"
                + (f"; {unknown} were never pushed by this run" if unknown else "")
            )
        lags.append(age)
        s.metadata[TOKEN_LAGS] = token_lags(s, ages, age)
    straddling = sum(len(versions_of(s.weight_versions)) > 1 for s in samples)  # a push landed among its tokens
    return {
        "policy_lag_max": max(lags),
        "policy_lag_mean": float(np.mean(lags)),
        "straddling_samples": straddling,
        **token_lag_shares(samples),
    }, lags


TOKEN_LAGS = "token_lags"  # metadata: each response token's lag (pushes since the weights that sampled it)


def token_lags(sample: Sample, ages: dict[str, int], default: int) -> np.ndarray:
    """Each response token's lag, from its version span (``default``, the sample's age, where no span says)."""
    out = np.full(len(sample.response_ids), default, np.int64)
    for span in live_spans(sample):
        out[span.start : span.end] = ages.get(span.version, default)
    return out


def token_lag_shares(samples: list[Sample]) -> dict:
    """``token_lag_{k}_share``: the share of the model's tokens (loss mask 1) sampled ``k`` pushes ago."""
    lags = [s.metadata[TOKEN_LAGS][np.asarray(s.loss_mask, bool)] for s in samples]
    flat = np.concatenate(lags) if lags else np.zeros(0, np.int64)
    if not flat.size:
        return {}
    values, counts = np.unique(flat, return_counts=True)
    return {f"token_lag_{int(k)}_share": float(n / flat.size) for k, n in zip(values, counts)}


def compare_with_rollout(
    rollout: int,
    samples: list[Sample],
    trainer_logp: list[torch.Tensor],
    *,
    tolerance: float,
    fail: bool,
    stale_kv: bool = False,
) -> dict:
    """Per-token ``|log pi - log mu|`` statistics; raises ``CITestError`` naming the rollout,
    sample and position of the worst token when ``fail`` and it exceeds ``tolerance`` (and, with
    ``stale_kv``, ``--weight-sync-mode in_place``, the push the token came after)."""
    diffs = [
        np.abs(lp.detach().double().cpu().numpy() - s.log_mu.astype(np.float64)) for s, lp in zip(samples, trainer_logp)
    ]
    compared = np.concatenate([unmasked(s) for s in samples])
    flat = np.concatenate(diffs)[compared]
    stats = {
        "train_rollout_logprob_abs_diff_max": float(flat.max()),
        "train_rollout_logprob_abs_diff_mean": float(flat.mean()),
        "train_rollout_unequal_tokens": int((flat != 0).sum()),
        "train_rollout_compared_tokens": int(flat.size),
    }
    if fail and not flat.max() <= tolerance:  # NaN compares false: it fails too
        diffs = [np.where(unmasked(s), d, 0.0) for s, d in zip(samples, diffs)]
        worst = int(np.argmax([d.max() for d in diffs]))
        t = int(np.argmax(diffs[worst]))
        s = samples[worst]
        raise CITestError(
            f"--ci-test failed at rollout {rollout}, sample {s.index}, response position {t}: trainer log pi "
            f"{float(trainer_logp[worst][t]):.6f} vs rollout log mu {float(s.log_mu[t]):.6f} "
            f"(|diff| {diffs[worst][t]:.3e} > tolerance {tolerance:g}; {int((flat > tolerance).sum())} tokens over)"
            + (after_stale_push(s, t) if stale_kv else "")
        )
    return stats


def unmasked(sample: Sample) -> np.ndarray:
    """Positions --ci-test compares: all but those masked for their age (``mask_beyond_lag``)."""
    keep = np.ones(len(sample.response_ids), bool)
    for start, end in sample.metadata.get(LAG_MASKED, ()):
        keep[start:end] = False
    return keep


def after_stale_push(sample: Sample, t: int) -> str:
    """Why a token sampled after an ``in_place`` push differs: the old weights' keys and values of its prefix."""
    spans = sample.weight_versions
    first = spans[0] if spans else None
    if first is None or t < first.end:
        return ""
    return (
        f"; it was sampled after the push at position {first.end} ({first.version!r} -> "
        f"{next(s.version for s in spans if s.start <= t < s.end)!r}) under --weight-sync-mode in_place, whose "
        "requests go on with the old weights' keys and values of their prefix: not the trained policy's "
        "distribution (--weight-sync-mode retract recomputes them)"
    )


class RolloutChecks:
    """--ci-test (every token against its log mu, under the weights that sampled it) and the support
    drift of one rollout's old scores: ``checks(r, samples, old, ages)`` -> ``(metrics, trained)``,
    ``trained`` being the samples left after the drift gate (``gate=False``: no gate)."""

    def __init__(
        self,
        ctx,
        *,
        replay: bool,
        ci_test: bool,
        tolerance: float,
        min_support_mass: float,
        versions,
        semantics: str,
        stale_kv: bool = False,
    ):
        self.ctx, self.replay, self.ci_test, self.tolerance = ctx, replay, ci_test, tolerance
        self.stale_kv = stale_kv  # --weight-sync-mode in_place: a failure after a push says why
        self.min_support_mass, self.versions = min_support_mass, versions
        self.semantics = semantics  # whose penalty rules the lagged scorer replays (the engine's)

    def __call__(self, r: int, samples: list[Sample], old, ages, clock, *, gate: bool = True) -> tuple[dict, list]:
        metrics = self._ci_check(r, samples, old.logp, clock) if old.logp is not None else {}
        drift, trained = support_drift(
            samples, old.logp, old.full, ages, self.replay, self.min_support_mass if gate else 0.0
        )
        return {**metrics, **drift}, trained

    def _ci_check(self, r: int, samples: list[Sample], logp: list, clock) -> dict:
        if not self.replay:  # without replay there is no log mu to compare with
            return {}
        lagged = self.versions.lagged
        if self.ci_test and self.versions.keeps_copies:
            with clock("ci_test_lagged"):  # the extra forward of older tokens under their own weights
                logp = on_main(
                    lambda: (
                        lagged.by_sampling_version(samples, logp, self.versions.current, self.semantics)
                        if lagged
                        else None
                    ),
                    self.ctx,
                )
        return compare_with_rollout(
            r, samples, logp, tolerance=self.tolerance, fail=self.ci_test, stale_kv=self.stale_kv
        )
