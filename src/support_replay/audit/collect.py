"""Score every sampled token with the trainer's forward and keep what the audit reads of it.

One forward per micro-batch, as ``train`` batches them: inside it the trainer's own scorer gives
the ratio's score (its head, its penalty replay, its kernels), and the LM head's full logits give
the full-vocabulary score, the unpenalised support score, the (penalised) logits at the support
ids for the temperature fit, and where the support can be compared the filter evidence
(``core/mismatch_parts.py``). Logits are read in chunks of rows; nothing ``[T, V]`` is kept.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from ..core.mismatch_parts import filter_evidence, ratio_parts
from ..core.sampling import SamplingParams

CHUNK_ROWS = 256  # rows of [rows, V] logits (and their sort) at a time


@dataclass
class TokenScores:
    """Flat per-token values of every scored response token, samples in index order."""

    sample: np.ndarray  # sample index
    position: np.ndarray  # position in its response
    token: np.ndarray
    log_mu: np.ndarray  # the engine's, float64
    trainer: np.ndarray  # the trainer's ratio score (support-normalised under replay, else full-vocabulary)
    full: np.ndarray  # full-vocabulary score at the trainer's logits
    support: np.ndarray  # support score of the raw logits
    penalised: np.ndarray  # support score of the penalised logits (== support without penalties)
    support_size: np.ndarray
    support_logits: torch.Tensor  # [N, K] (penalised) logits at the support ids, padded
    support_valid: torch.Tensor  # [N, K]
    column: torch.Tensor  # [N] the token's place in its padded row
    evidence: dict[str, np.ndarray] | None = None  # filter evidence (None: not comparable)
    routing: tuple[int, int] = (0, 0)  # (equal top-k choices, compared) under routing replay


class AuditPass:
    """``scorer.rows`` for ``ScoringModel.forward``: the trainer's score and the audit's parts."""

    def __init__(self, model, trainer_scorer, params: SamplingParams, semantics: str, evidence: bool):
        self.model, self.trainer, self.params, self.semantics = model, trainer_scorer, params, semantics
        self.evidence = evidence

    def rows(self, h, targets, support, transform):
        logp = self.trainer.rows(h, targets, support, transform)[0]
        head = self.model.hf.get_output_embeddings()
        ids, valid = support
        parts, evidence = [], []
        for start in range(0, len(targets), CHUNK_ROWS):
            cut = slice(start, start + CHUNK_ROWS)
            logits = head(h[cut]).float()
            chunk_transform = None if transform is None else _rows(transform, cut)
            parts.append(
                ratio_parts(logits, targets[cut], ids[cut], valid[cut], self.params.temperature, chunk_transform)
            )
            if self.evidence:
                evidence.append(filter_evidence(logits, ids[cut], valid[cut], self.params, self.semantics))
        joined = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        if evidence:
            joined["evidence"] = {k: torch.cat([e[k] for e in evidence]) for k in evidence[0]}
        return logp, joined


def _rows(transform, cut: slice):
    """The penalty transform of a micro-batch restricted to rows ``cut``."""
    bias = transform.bias
    if bias is not None:
        bias = tuple(b[cut] for b in bias)
    return replace(transform, out_counts=transform.out_counts[cut], seen=transform.seen[cut], bias=bias)


@torch.no_grad()
def score_samples(actor, trainer_scorer, steps, samples, params: SamplingParams, semantics: str, evidence: bool):
    """``TokenScores`` of every sample, micro-batch by micro-batch in the run's layout."""
    model = actor.model
    audit = AuditPass(model, trainer_scorer, params, semantics, evidence)
    got: dict[int, tuple] = {}
    routing = model.routing
    if routing is not None:
        routing.take_agreement()
    for batch in (mb for step in steps for mb in step.micro_batches):
        logp, parts = model(batch, audit)
        ids, valid = batch.support
        pieces = batch.split(torch.arange(batch.num_tokens))
        for index, rows in zip(batch.indices, pieces):
            got[index] = (
                logp[rows],
                {k: v[rows] for k, v in parts.items() if k != "evidence"},
                {k: v[rows] for k, v in parts.get("evidence", {}).items()},
                valid[rows],
            )
    agreement = routing.take_agreement() if routing is not None and model.replay_routing else (0, 0)
    order = sorted(got)
    width = max(int(got[i][3].shape[1]) for i in order)

    def padded(x, value):
        return torch.nn.functional.pad(x, (0, width - x.shape[1]), value=value)

    cat = np.concatenate
    out = TokenScores(
        sample=cat([np.full(samples[i].response_length, i) for i in order]),
        position=cat([np.arange(samples[i].response_length) for i in order]),
        token=cat([np.asarray(samples[i].response_ids) for i in order]),
        log_mu=cat([np.asarray(samples[i].log_mu, np.float64) for i in order]),
        trainer=cat([got[i][0].double().numpy() for i in order]),
        full=cat([got[i][1]["full"].double().numpy() for i in order]),
        support=cat([got[i][1]["support"].double().numpy() for i in order]),
        penalised=cat([got[i][1]["penalised"].double().numpy() for i in order]),
        support_size=cat([samples[i].support.sizes() for i in order]),
        support_logits=torch.cat([padded(got[i][1]["support_logits"], 0.0) for i in order]),
        support_valid=torch.cat([padded(got[i][3], False) for i in order]),
        column=torch.cat([got[i][1]["column"] for i in order]),
        routing=agreement,
    )
    if evidence:
        out.evidence = {k: cat([got[i][2][k].numpy() for i in order]) for k in got[order[0]][2]}
    return out
