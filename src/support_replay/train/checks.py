"""``--ci-test``: the trainer's log-prob of every token against the log mu the engine recorded.

Run on every rollout before its first optimizer step, on the scores of the ratio's own
path. In true-on-policy mode the tolerance is 0: one token that differs in its last bit
fails the run.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CITestError
from ..rollout.sample import Sample


def compare_with_rollout(rollout: int, samples: list[Sample], trainer_logp: list[torch.Tensor], *, tolerance: float, fail: bool) -> dict:
    """Per-token ``|log pi - log mu|`` statistics; raises ``CITestError`` naming the rollout,
    sample and position of the worst token when ``fail`` and it exceeds ``tolerance``."""
    diffs = [np.abs(lp.detach().double().cpu().numpy() - s.log_mu.astype(np.float64)) for s, lp in zip(samples, trainer_logp)]
    flat = np.concatenate(diffs)
    stats = {
        "train_rollout_logprob_abs_diff_max": float(flat.max()),
        "train_rollout_logprob_abs_diff_mean": float(flat.mean()),
        "train_rollout_unequal_tokens": int((flat != 0).sum()),
    }
    if fail and flat.max() > tolerance:
        worst = int(np.argmax([d.max() for d in diffs]))
        t = int(np.argmax(diffs[worst]))
        s = samples[worst]
        raise CITestError(
            f"--ci-test failed at rollout {rollout}, sample {s.index}, response position {t}: trainer log pi "
            f"{float(trainer_logp[worst][t]):.6f} vs rollout log mu {float(s.log_mu[t]):.6f} "
            f"(|diff| {diffs[worst][t]:.3e} > tolerance {tolerance:g}; {int((flat > tolerance).sum())} tokens over)"
        )
    return stats
