"""The sampling half of a step: penalties over each request's history, the grammar and min-tokens masks,
the replay core's sampler, capture; one typed record per row, a failing row failing alone."""

from __future__ import annotations

import logging

import torch

from ..core.penalties import dense_history, penalise
from ..core.sampling import sample_tokens
from .capture import captured_rows
from .row_step import RowFailure, RowStep
from .running import RunningRequest

log = logging.getLogger(__name__)


class SamplingStep:
    """``step(seqs, logits) -> [RowStep | RowFailure]``, under the engine's filter semantics and capacity."""

    def __init__(
        self, semantics: str, capacity: int, eos_ids: frozenset[int] = frozenset(), grammars=None, select=None
    ):
        self.semantics = semantics
        self.capacity = capacity
        self.eos_ids = frozenset(eos_ids)
        self.grammars = grammars  # engine/grammar.py: the structured outputs' masks
        # the top-k selection of SGLang's rule (kernels/top_candidates.py; None: torch.topk), the same support
        self.select = select

    def __call__(self, seqs: list[RunningRequest], logits: torch.Tensor) -> list[RowStep | RowFailure]:
        try:
            return self._draw(seqs, logits)
        except Exception:
            log.exception("sampling %d rows failed; sampling them one by one", len(seqs))
        rows: list[RowStep | RowFailure] = []
        for row, seq in enumerate(seqs):
            try:
                rows += self._draw([seq], logits[row : row + 1])
            except Exception as exc:
                rows.append(RowFailure(exc, "sampling"))
        return rows

    def _draw(self, seqs: list[RunningRequest], logits: torch.Tensor) -> list[RowStep | RowFailure]:
        penalised = self._penalised(seqs, logits)
        logits = self._masked(seqs, penalised)
        requests = [s.request for s in seqs]
        capture = [r.return_sampling_mask for r in requests]
        out = sample_tokens(
            logits,
            [r.params for r in requests],
            self.semantics,
            generator=[s.generator for s in seqs],
            capture=True if all(capture) else capture,  # every row's (a rollout): no flags to read
            select=self.select,
        )
        lengths = [len(s.output_ids) for s in seqs]
        return captured_rows(requests, logits, out, self.capacity, lengths, full_logits=penalised)

    def _masked(self, seqs: list[RunningRequest], logits: torch.Tensor) -> torch.Tensor:
        """EOS and the stop tokens at -inf in the rows still short of their ``min_new_tokens`` (vLLM's
        min-tokens processor), before the filters: the captured support never holds a masked id, so the
        trainer's support score needs nothing new."""
        if self.grammars is not None and any(s.grammar is not None for s in seqs):
            logits = self.grammars.mask([s.grammar for s in seqs], logits)  # the grammar's, before the filters too
        rows = [i for i, s in enumerate(seqs) if len(s.output_ids) < s.request.min_new_tokens]
        if not rows:
            return logits
        logits = logits.clone()
        for i in rows:
            req = seqs[i].request
            banned = set(req.stop_token_ids) | (set() if req.ignore_eos else set(self.eos_ids))
            banned = sorted(t for t in banned if t < logits.shape[1])
            logits[i, banned] = float("-inf")
        return logits

    def _penalised(self, seqs: list[RunningRequest], logits: torch.Tensor) -> torch.Tensor:
        """Penalties and logit bias of the rows that have them, over each request's own history
        (core/penalties.penalise, the trainer's transform); the filters and log mu see the result."""
        rows = [i for i, s in enumerate(seqs) if s.request.penalties.active]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            seq, req = seqs[i], seqs[i].request
            counts, seen = dense_history(req.input_ids, seq.output_ids, vocab, self.semantics, logits.device)
            row = penalise(logits[i].float(), counts, seen, seq.bias, req.penalties, self.semantics)
            logits[i] = row.to(logits.dtype)
        return logits
