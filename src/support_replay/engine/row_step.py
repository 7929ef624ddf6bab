"""What one engine step produced for one row: a typed record, or the typed failure of that row."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class RowStep:
    """The token sampled for one row, with what its request asked to capture (``None`` otherwise)."""

    token: int
    support: np.ndarray | None = None  # canonical ids of the realized support S_t
    log_mu: float | None = None  # log mu of the token, renormalised over S_t
    full_logprob: float | None = None  # full-vocabulary log-prob of the token (return_logprob)
    support_row_logprobs: np.ndarray | None = None  # log mu of every id of S_t (sampling_logprobs_mode "support")
    top: tuple[np.ndarray, np.ndarray] | None = None  # (ids, log-probs) of the full distribution's top_logprobs


@dataclass(frozen=True)
class RowFailure:
    """The row's request fails alone; ``where`` names the stage in its error (``capture``, ``sampling``)."""

    error: Exception
    where: str
