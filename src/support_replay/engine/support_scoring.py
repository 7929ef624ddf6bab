"""A served teacher's scoring (``/score_support``): one forward over a whole sequence, and at every response
position the full-vocabulary log-softmax (temperature 1) read at the ids the caller lists for it (a student's
replayed support) and at the token that follows. Run on the engine's thread between steps
(``Engine.call_between_steps``), so no decode step runs on the model meanwhile."""

from __future__ import annotations

import torch

from ..errors import RequestError

MAX_SCORED_IDS = 1 << 22  # ids over all positions of one request: the answer's size


def check_support_request(input_ids: list[int], response_start: int, support_ids: list[list[int]], vocab: int):
    """``RequestError`` naming the field and the first bad value, before anything runs."""
    n = len(input_ids)
    if not 1 <= response_start < n:
        raise RequestError(f"response_start={response_start}: must be in [1, {n - 1}] for {n} input_ids")
    if len(support_ids) != n - response_start:
        raise RequestError(
            f"support_ids: {len(support_ids)} lists for {n - response_start} response positions "
            f"(input_ids[{response_start}:])"
        )
    bad = next((i for i, t in enumerate(input_ids) if not 0 <= t < vocab), None)
    if bad is not None:
        raise RequestError(f"input_ids[{bad}]={input_ids[bad]}: outside the vocabulary [0, {vocab})")
    total = 0
    for p, ids in enumerate(support_ids):
        if not ids:
            raise RequestError(f"support_ids[{p}]: empty (every position needs the ids to score)")
        wrong = next((i for i in ids if not 0 <= i < vocab), None)
        if wrong is not None:
            raise RequestError(f"support_ids[{p}] holds {wrong}: outside the vocabulary [0, {vocab})")
        total += len(ids)
    if total > MAX_SCORED_IDS:
        raise RequestError(f"support_ids: {total} ids in all, more than {MAX_SCORED_IDS}")


@torch.inference_mode()
def score_support(
    model, input_ids: list[int], response_start: int, support_ids: list[list[int]], device="cpu"
) -> tuple[list[list[float]], list[float]]:
    """``(log p at each position's listed ids, log p of each response token)``, float32 values."""
    ids = torch.tensor([input_ids], dtype=torch.long, device=device)
    logits = model(input_ids=ids, use_cache=False).logits[0, response_start - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    width = max(len(s) for s in support_ids)
    padded = torch.tensor([s + [s[0]] * (width - len(s)) for s in support_ids], dtype=torch.long, device=device)
    at = logp.gather(1, padded).cpu().tolist()
    tokens = logp.gather(1, ids[0, response_start:, None]).squeeze(1).cpu().tolist()
    return [row[: len(s)] for row, s in zip(at, support_ids)], tokens
