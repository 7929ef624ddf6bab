"""What the audit concludes beyond the figures: settings drift, boundary flips, staleness.

A finding names the setting and carries its evidence (docs/audit.md, "settings drift"). Supports
are compared with the declared settings at the trainer's logits, with a margin for numerics: a
support that is off by less than the margin is a boundary flip (the trainer's logits would put
the cut elsewhere), one off by more is evidence that the engine filtered with other settings.
Where the supports are narrower than declared, each single setting that would explain every
such support is named with the value it would have (an engine default the run does not declare).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np
import torch

from ..core.mismatch_parts import fit_temperature, temperature_residual

MIN_ROWS = 3  # supports narrower than declared: at least this many (and 1% of them) make a finding
RATIO_FLOOR = 1e-6  # an id left out below this p / p_max is underflow or rounding, not a filter
TEMPERATURE_RTOL = 0.01  # a fitted temperature this far from the declared one, explaining log mu 10x better


@dataclass(frozen=True)
class Finding:
    setting: str  # the setting it names: top_k, top_p, min_p, temperature, weight_version, supports
    evidence: str
    rows: int  # tokens that show it
    examples: list  # [{"sample", "position"}, ...]

    def to_json(self) -> dict:
        return asdict(self)


def examples(scores, where: np.ndarray, limit: int = 5) -> list:
    at = np.flatnonzero(where)[:limit]
    return [{"sample": int(scores.sample[i]), "position": int(scores.position[i])} for i in at]


def margin_of(numerics: np.ndarray) -> float:
    """Relative margin for comparing supports: a log-prob error e moves probabilities by about e."""
    if not len(numerics):
        return 1e-3
    return float(min(0.2, max(1e-3, 4 * np.quantile(np.abs(numerics), 0.99))))


def filter_findings(scores, declared: dict, vocab: int, margin: float) -> tuple[list[Finding], np.ndarray]:
    """``(findings, flips)``: drift of top_k / top_p / min_p, and the tokens whose support differs from
    the declared filter's at the trainer's logits by less than ``margin`` (boundary flips)."""
    ev = scores.evidence
    k, top_p, min_p = declared["top_k"], declared["top_p"], declared["min_p"]
    findings, drift = [], np.zeros(len(scores.sample), bool)
    if k > 0:
        over = ev["observed"] > k
        if over.any():
            findings.append(
                Finding(
                    "top_k",
                    f"{int(over.sum())} supports have more ids than the declared top_k={k} (up to "
                    f"{int(ev['observed'].max())}): the engine's top_k is larger, or none",
                    int(over.sum()),
                    examples(scores, over),
                )
            )
            drift |= over
    if top_p < 1:
        over = ev["kept_mass"] > top_p + margin
        if over.any():
            findings.append(
                Finding(
                    "top_p",
                    f"{int(over.sum())} supports keep an id whose exclusive prefix mass (up to "
                    f"{float(ev['kept_mass'][over].max()):.4f}) is above the declared top_p={top_p}: the engine's "
                    "top_p is larger, or none",
                    int(over.sum()),
                    examples(scores, over),
                )
            )
            drift |= over
    if min_p > 0:
        under = ev["kept_ratio"] < min_p * (1 - margin)
        if under.any():
            findings.append(
                Finding(
                    "min_p",
                    f"{int(under.sum())} supports keep an id with p / p_max down to "
                    f"{float(ev['kept_ratio'][under].min()):.4g}, under the declared min_p={min_p}: the engine's min_p "
                    "is smaller, or none",
                    int(under.sum()),
                    examples(scores, under),
                )
            )
            drift |= under
    narrow_findings, narrow = _narrower(scores, declared, vocab, margin)
    findings += narrow_findings
    drift |= narrow
    differs = ev["common"] != np.maximum(ev["observed"], ev["expected"])
    return findings, differs & ~drift


def _narrower(scores, declared: dict, vocab: int, margin: float) -> tuple[list[Finding], np.ndarray]:
    """Supports that leave out an id the declared settings keep by more than the margin, and which
    single setting, at which value, explains all of them."""
    ev = scores.evidence
    k, top_p, min_p = declared["top_k"], declared["top_p"], declared["min_p"]
    cap = k if k > 0 else vocab
    # the engine kept an id the trainer ranks below the one it left out, and not clearly less probable: the two
    # sides' logits order them differently (bf16 against fp32 at the top_k cut), a boundary flip, not a filter
    reordered = (ev["kept_rank"] > ev["first_out_rank"]) & (ev["first_out_ratio"] <= ev["kept_ratio"] * (1 + margin))
    cut = (
        ev["first_out_expected"]
        & (ev["first_out_rank"] >= 0)
        & (ev["first_out_rank"] < cap)
        & ((ev["first_out_mass"] < top_p - margin) | (top_p >= 1))
        & (ev["first_out_ratio"] > max(min_p * (1 + margin), RATIO_FLOOR))
        & ~reordered
    )
    n = int(cut.sum())
    if n < max(MIN_ROWS, math.ceil(0.01 * len(cut))):
        return [], np.zeros(len(cut), bool)
    out = []
    largest = int(ev["observed"].max())
    if largest < cap and bool((ev["observed"][cut] == largest).all()):
        out.append(
            Finding(
                "top_k",
                f"no support has more than {largest} ids, and {n} stop at exactly {largest} although the declared "
                f"settings (top_k={k}) keep the next id at the trainer's logits: the engine applies top_k={largest} "
                "(an engine default, such as a generation_config.json the run does not declare?)",
                n,
                examples(scores, cut),
            )
        )
    kept_mass = float(ev["kept_mass"].max())
    if kept_mass < top_p - margin and bool((ev["first_out_mass"][cut] > kept_mass).all()):
        out.append(
            Finding(
                "top_p",
                f"{n} supports stop before the declared top_p={top_p}: no kept id has an exclusive prefix mass above "
                f"{kept_mass:.4f} and every id left out has more: the engine applies a top_p of about {kept_mass:.3f}",
                n,
                examples(scores, cut),
            )
        )
    kept_ratio = float(ev["kept_ratio"].min())
    if kept_ratio > min_p * (1 + margin) and bool((ev["first_out_ratio"][cut] < kept_ratio).all()):
        out.append(
            Finding(
                "min_p",
                f"{n} supports leave out ids above the declared min_p={min_p}: every kept id has p / p_max >= "
                f"{kept_ratio:.4g} and every id left out less: the engine applies a min_p of about {kept_ratio:.3g}",
                n,
                examples(scores, cut),
            )
        )
    if not out:
        out.append(
            Finding(
                "supports",
                f"{n} supports leave out an id the declared settings keep at the trainer's logits, and no single "
                "top_k, top_p or min_p explains them all (a logit bias, a grammar, another filter?)",
                n,
                examples(scores, cut),
            )
        )
    return out, cut


def residuals(scores, temperature: float) -> np.ndarray:
    """``log mu`` minus the support score at ``temperature``, per token (0 on singletons)."""
    log_mu = torch.from_numpy(scores.log_mu)
    return temperature_residual(scores.support_logits, scores.support_valid, scores.column, log_mu, temperature).numpy()


def temperature_finding(scores, temperature: float) -> tuple[Finding | None, dict]:
    """Whether log mu is reproduced at the declared temperature or clearly better at another."""
    valid = scores.support_valid
    fitted = fit_temperature(scores.support_logits, valid, scores.column, torch.from_numpy(scores.log_mu))
    informative = (valid.sum(-1) >= 2).numpy()
    if math.isnan(fitted):
        return None, {"fitted": None, "rows": 0}
    at = {
        name: float(np.abs(residuals(scores, t)[informative]).mean())
        for name, t in (("declared", temperature), ("fitted", fitted))
    }
    figures = {
        "fitted": fitted,
        "rows": int(informative.sum()),
        "mean_abs_error_declared": at["declared"],
        "mean_abs_error_fitted": at["fitted"],
    }
    off = abs(fitted / temperature - 1) > TEMPERATURE_RTOL and at["declared"] > max(1e-4, 10 * at["fitted"])
    if not off:
        return None, figures
    return (
        Finding(
            "temperature",
            f"log mu is reproduced at temperature {fitted:.4f} (mean |error| {at['fitted']:.2e} over "
            f"{figures['rows']} supports of two ids or more), not at the declared {temperature} (mean |error| "
            f"{at['declared']:.2e}): the engine samples at another temperature",
            figures["rows"],
            examples(scores, informative),
        ),
        figures,
    )


def staleness(samples, expected: str | None) -> tuple[Finding | None, dict]:
    """Tokens by the weight version that sampled them, against ``expected``."""
    counts: dict[str, int] = {}
    for s in samples:
        for span in s.weight_versions:
            counts[span.version] = counts.get(span.version, 0) + span.end - span.start
    unreported = sum(s.response_length for s in samples) - sum(counts.values())
    figures = {"expected": expected, "tokens_by_version": counts, "tokens_without_version": unreported}
    if expected is None:
        return None, figures
    other = {v: n for v, n in counts.items() if v != expected}
    if not other and not unreported:
        return None, figures
    stale = [s for s in samples if any(span.version != expected for span in s.weight_versions) or not s.weight_versions]
    what = ", ".join(f"{n} tokens by {v!r}" for v, n in other.items())
    if unreported:
        what = f"{what}, {unreported} tokens with no version" if what else f"{unreported} tokens with no version"
    return (
        Finding(
            "weight_version",
            f"expected every token from weights {expected!r}: {what}",
            sum(other.values()) + unreported,
            [{"sample": s.index, "position": 0} for s in stale[:5]],
        ),
        figures,
    )
