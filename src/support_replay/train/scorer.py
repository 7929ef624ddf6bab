"""The scoring function of a pass, chosen once: ``scores = scorer(batch)``.

The ratio's score comes from one head, fixed when the scorer is built from the run's layout and
flags, so the old and the new log-probs of a PPO ratio are one function (docs/math.md, "which
function scores"):

    sparse   replay, a plain linear head, nothing full-vocabulary with a gradient: the support's
             rows of the head only (``sparse_head_support_logprobs``, never ``[T, V]``)
    invariant  the same in true-on-policy mode: each support id's logit by the invariant arithmetic's dot
             (kernels/invariant.dots), the element of the engine's full head, so its bits; then the
             core's ``support_logprobs`` over them
    dense    replay otherwise: the full head, then the core's ``support_logprobs`` (its
             vocab-parallel form under tensor parallelism; ``penalised_support_logprobs`` for a
             batch that brings the rollout's penalties)
    full     no replay: full-vocabulary log-probs

``Outputs`` says what else the pass needs beside the ratio's score (full-vocabulary log-prob and
entropy with a gradient, or a detached full log-prob for metrics); they never change ``logp``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..core.logprobs import (
    full_logprobs,
    head_rows_at,
    penalised_support_logprobs,
    sparse_head_support_logprobs,
    support_logprobs,
    support_rows_logprobs,
    target_positions,
)
from ..errors import ConfigError
from ..kernels import invariant

if TYPE_CHECKING:
    from .actor import ScoringModel
    from .batches import MicroBatch

HEADS = ("sparse", "invariant", "dense", "full")


@dataclass(frozen=True)
class Outputs:
    """What a pass needs beside the ratio's score."""

    full: bool = False  # full-vocabulary log-prob with a gradient (KL loss)
    entropy: bool = False  # full-vocabulary entropy with a gradient (entropy bonus)
    full_detached: bool = False  # full-vocabulary log-prob without one (metrics)
    support_rows: bool = False  # log pi(v | S_t) of every support id, with a gradient (score centering)


@dataclass
class BatchScores:
    """Flat per-token scores of one micro-batch, response tokens in its sample order."""

    logp: torch.Tensor  # the ratio's score: support-normalised under replay, else full-vocabulary
    full: torch.Tensor | None = None  # full-vocabulary log-prob
    entropy: torch.Tensor | None = None  # full-vocabulary entropy
    support_logp: torch.Tensor | None = None  # [N, K] log p of every support id, where a pass asks for it (0: padding)


def head_for(*, replay: bool, sparse: bool, batch_invariant: bool) -> str:
    if sparse and not replay:
        raise ConfigError("the sparse head scores the captured support: it needs sampling-support replay")
    if sparse:
        return "invariant" if batch_invariant else "sparse"
    return "dense" if replay else "full"


class Scorer:
    """``scorer(batch) -> BatchScores`` on ``model`` at ``temperature``, its head chosen here."""

    def __init__(
        self, model: ScoringModel, temperature: float, *, replay: bool, sparse: bool, outputs: Outputs = Outputs()
    ):
        self.model, self.temperature, self.outputs = model, temperature, outputs
        self.head = head_for(replay=replay, sparse=sparse, batch_invariant=model.batch_invariant)
        self._full_fn, self._support_fn = model.head_functions()
        self.rows = getattr(self, f"_{self.head}_rows")  # called inside the model's forward (FSDP2 root)

    def __call__(self, batch: MicroBatch) -> BatchScores:
        logp, full, entropy, rows = self.model(batch, self)
        return BatchScores(logp, full, entropy, rows)

    def _support_rows(self, logits_at_ids, support, transform):
        """``[N, K]`` log pi(v | S_t) of every support id, when the pass asks for them: ``logits_at_ids(ids)`` the
        logits at the padded ids (penalised here where the batch brings penalties)."""
        if not self.outputs.support_rows:
            return None
        ids, valid = support
        z = logits_at_ids(ids)
        z = z if transform is None else transform(z.float(), ids)
        return support_rows_logprobs(z, valid, self.temperature)

    def _sparse_rows(self, h, targets, support, transform):
        self._refuse_transform(transform)
        head = self.model.hf.get_output_embeddings()
        logp = sparse_head_support_logprobs(h, head.weight, targets, support, self.temperature)
        rows = self._support_rows(lambda ids: head_rows_at(h, head.weight, ids), support, None)
        return logp, self._detached_full(head, h, targets), None, rows

    def _invariant_rows(self, h, targets, support, transform):
        self._refuse_transform(transform)
        head = self.model.hf.get_output_embeddings()
        ids, valid = support
        z = invariant.dots(h, head.weight, ids, valid)  # [N, K]: the engine's logits at the support ids, its bits
        column = target_positions(ids, valid, targets)  # each target's place in its support row
        # the same function as the engine's log mu over the same values in the same order (its support's)
        where = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        logp = support_logprobs(z, column, (where, valid), self.temperature)
        rows = self._support_rows(lambda _: z, support, None)
        return logp, self._detached_full(head, h, targets), None, rows

    def _refuse_transform(self, transform) -> None:
        if transform is not None:  # the actor takes the dense head when the rollout has penalties
            raise ConfigError(
                f"the {self.head} head scores raw logits: this batch brings penalties (use the dense head)"
            )

    def _detached_full(self, head, h, targets):
        if not self.outputs.full_detached:
            return None
        with torch.no_grad():
            return full_logprobs(head(h.detach()), targets, self.temperature)  # the metrics' log-probs alone

    def _dense_rows(self, h, targets, support, transform):
        logits = self.model.hf.get_output_embeddings()(h)  # tensor parallel: this rank's vocabulary columns
        full, entropy = self._full_outputs(logits, targets)
        if transform is not None:  # refused with tensor parallelism (train/config.py)
            logp = penalised_support_logprobs(logits, targets, support, self.temperature, transform)
        else:
            logp = self._support_fn(logits, targets, support, self.temperature)
        rows = self._support_rows(lambda ids: self.model.logits_at(logits, ids), support, transform)
        return logp, full, entropy, rows

    def _full_rows(self, h, targets, support, transform):
        logits = self.model.hf.get_output_embeddings()(h)
        full, entropy = self._full_fn(logits, targets, self.temperature)
        return full, full, entropy if self.outputs.entropy else None, None

    def _full_outputs(self, logits, targets):
        out = self.outputs
        if out.full or out.entropy:
            full, entropy = self._full_fn(logits, targets, self.temperature)
            return full, entropy if out.entropy else None
        if out.full_detached:
            with torch.no_grad():
                return self._full_fn(logits.detach(), targets, self.temperature)[0], None
        return None, None
