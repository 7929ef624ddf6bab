"""Capture: the support, log mu and log-probs a request asked for, cut out of one step's sampling,
and the experts a mixture-of-experts forward routed each fed token to.

One function per captured quantity, each over the rows that asked.
"""

from __future__ import annotations

import numpy as np
import torch

from ..core.logprobs import full_logprobs, support_row_logprobs, top_full_logprobs
from ..core.sampling import SampledTokens
from ..errors import CapacityError
from .row_step import RowFailure, RowStep


def full_logprobs_of(requests, logits: torch.Tensor, tokens: torch.Tensor) -> dict[int, float]:
    """Full-vocabulary log-probs of the sampled tokens, for the rows whose request has ``return_logprob``:
    the trainer's function, so the two can agree bit for bit."""
    rows = [i for i, r in enumerate(requests) if r.return_logprob]
    if not rows:
        return {}
    index = torch.tensor(rows)
    temps = torch.tensor([requests[i].params.temperature or 1.0 for i in rows])
    return dict(zip(rows, full_logprobs(logits[index], tokens[index], temps).tolist()))


def top_logprobs_of(requests, logits: torch.Tensor) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """``(ids, log-probs)`` of the ``top_logprobs`` most likely ids of the full distribution, for the rows
    that asked (one sort per row that asked, none for the others)."""
    out = {}
    for row, request in enumerate(requests):
        k = min(request.top_logprobs, logits.shape[1])
        if k:
            values, ids = top_full_logprobs(logits[row : row + 1], k, request.params.temperature or 1.0)
            out[row] = (ids[0].numpy().astype(np.int64), values[0].numpy().astype(np.float32))
    return out


def support_logprobs_of_row(logits_row: torch.Tensor, row_ids: np.ndarray, temperature: float | None) -> np.ndarray:
    """log mu of every id of the support, in O(|S|), with the selected token's bits."""
    ids = torch.from_numpy(row_ids.astype(np.int64))
    return support_row_logprobs(logits_row, ids, temperature or 1.0).numpy()


def captured_rows(
    requests,
    logits: torch.Tensor,
    out: SampledTokens,
    capacity: int,
    output_lengths: list[int],
    full_logits: torch.Tensor | None = None,
) -> list[RowStep | RowFailure]:
    """One record per row from a sampling step: the token, and the support and log mu where captured;
    a support larger than ``capacity`` fails that row (nothing of its request is returned). Full-vocabulary
    log-probs come from ``full_logits`` where given (the logits before a min-tokens mask: the trainer's)."""
    full_logits = logits if full_logits is None else full_logits
    full = full_logprobs_of(requests, full_logits, out.tokens)
    top = top_logprobs_of(requests, full_logits)
    captured = dict(zip(out.captured.tolist(), range(len(out.captured))))
    sizes, offsets, ids = out.support.sizes(), out.support.offsets, out.support.ids
    log_mu, tokens = out.log_mu.tolist(), out.tokens.tolist()
    rows: list[RowStep | RowFailure] = []
    for row, request in enumerate(requests):
        i = captured.get(row)
        if i is None:
            rows.append(RowStep(tokens[row], full_logprob=full.get(row), top=top.get(row)))
            continue
        if sizes[i] > capacity:
            error = CapacityError(
                f"realized support of {int(sizes[i])} tokens at output position {output_lengths[row]} "
                f"exceeds sampling_mask_max_tokens={capacity}; nothing of this request is returned"
            )
            rows.append(RowFailure(error, "capture"))
            continue
        support = ids[offsets[i] : offsets[i + 1]]
        row_logprobs = None
        if request.sampling_logprobs_mode == "support":
            row_logprobs = support_logprobs_of_row(logits[row], support, request.params.temperature)
        rows.append(RowStep(tokens[row], support, log_mu[i], full.get(row), row_logprobs, top.get(row)))
    return rows


def keep_routing(seqs, rows) -> None:
    """Each sequence that asked keeps its rows of a forward's routing (``rows[i]``: a prompt's
    ``[len, layers, top_k]`` after a prefill, one fed token's ``[layers, top_k]`` after a decode step),
    as int32 (the wire narrows it)."""
    for seq, routed in zip(seqs, rows):
        if seq.request.return_routed_experts:
            seq.routing.append(routed.numpy().astype(np.int32).reshape(-1, *routed.shape[-2:]))
