"""Synthetic support streams drawn from a measured support-size distribution.

Measured on a 1.5B reasoning model at top_p 0.97 / top_k 512: mean |S| about 8, median 2,
p99 about 82, 45-48% singletons. Here: 46.5% singletons, otherwise 2 + floor(LogNormal(1.7, 1.3))
capped at 512 (mean 8.0, median 2, p99 83). Ids are uniform over the vocabulary, the
selected token one of them: the hardest case for a coder (no locality to exploit).
"""

from __future__ import annotations

import numpy as np

from support_replay import SupportTable

SINGLETON_SHARE = 0.465
LOGNORMAL_MU, LOGNORMAL_SIGMA = 1.7, 1.3
MAX_SIZE = 512


def support_sizes(tokens: int, rng: np.random.Generator, cap: int = MAX_SIZE) -> np.ndarray:
    single = rng.random(tokens) < SINGLETON_SHARE
    tail = 2 + np.floor(rng.lognormal(LOGNORMAL_MU, LOGNORMAL_SIGMA, tokens)).astype(np.int64)
    return np.where(single, 1, np.minimum(tail, cap))


def support_stream(tokens: int, vocab: int, seed: int = 0, sizes: np.ndarray | None = None):
    """``(table, selected)``: a SupportTable of ``tokens`` rows and the sampled token of each row."""
    rng = np.random.default_rng(seed)
    sizes = support_sizes(tokens, rng) if sizes is None else np.asarray(sizes, np.int64)
    offsets = np.zeros(tokens + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    # distinct ids per row: draw with replacement, then redraw the few collisions
    ids = rng.integers(0, vocab, offsets[-1])
    rows = np.repeat(np.arange(tokens), sizes)
    while True:
        order = np.lexsort((ids, rows))
        dup = np.zeros(len(ids), bool)
        dup[order[1:]] = (ids[order[1:]] == ids[order[:-1]]) & (rows[order[1:]] == rows[order[:-1]])
        if not dup.any():
            break
        ids[dup] = rng.integers(0, vocab, int(dup.sum()))
    table = SupportTable.from_csr(ids.astype(np.int32), offsets)
    pick = offsets[:-1] + (rng.random(tokens) * sizes).astype(np.int64)
    selected = table.ids[pick].astype(np.int64)
    return table, selected
