"""Repetition, frequency and presence penalties and logit bias, as each engine applies them
(docs/math.md, "Penalties and logit bias").

Every one of these is a function of the logits and of the token history the engine saw, so
the trainer can apply the same function to the actor's logits before scoring on the captured
support. ``penalise`` is that function, elementwise: the engine calls it on a whole row
``[V]`` before it filters and samples; the trainer calls it on the logits gathered at the
support ids ``[N, K]``, with the history counts of those ids (``history_counts``), so no
``[N, V]`` tensor is formed. Equal inputs give equal bits.

Semantics, read from the engines' code:

- ``sglang`` (0.5.23, ``srt/sampling/penaltylib``, ``SamplingBatchInfo``): the additive
  penalties are accumulated into one tensor, ``(0 - f*) - p`` (``f*``: the frequency
  penalty added once per occurrence, in fp32), added to the logits; then the repetition
  scaling ``z < 0 ? z*r : z/r``; then the logit bias. History: the request's output tokens.
- ``vllm`` (0.32, ``v1/sample/sampler.py``, ``model_executor/layers/utils.py``): the logit
  bias first; then ``z * (z > 0 ? 1/r : r)`` for ids in the prompt or the output; then
  ``- f*count`` and ``- p*[count > 0]`` over the output.
- ``hf`` (transformers' processors): the bias (``SequenceBiasLogitsProcessor``), then
  ``z < 0 ? z*r : z/r`` for ids in the input ids (prompt and output). No frequency or
  presence penalty exists there: refused.

Temperature divides the result, and the support filters see it, in every engine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from ..errors import SamplingParamsError
from .sampling import SEMANTICS  # the samplers' semantics, named once

MAX_LOGIT_BIAS = 1e6  # logit + bias stays finite in float32 and far past any logit: it bans or forces an id


@dataclass(frozen=True)
class Penalties:
    """The penalty settings of one request; ``logit_bias`` as ``((id, bias), ...)`` sorted by id."""

    frequency: float = 0.0
    presence: float = 0.0
    repetition: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self):
        for name in ("frequency", "presence", "repetition"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SamplingParamsError(f"{name}_penalty: must be a finite number, got {value!r}")
        # SGLang 0.5.23's bounds (SamplingParams.verify, read from its wheel); past them a float32 logit can reach inf
        for name in ("frequency", "presence"):
            if not -2 <= getattr(self, name) <= 2:
                raise SamplingParamsError(f"{name}_penalty: must be in [-2, 2], got {getattr(self, name)!r}")
        if not 0 < self.repetition <= 2:
            raise SamplingParamsError(f"repetition_penalty: must be in (0, 2] (1 = none), got {self.repetition}")
        ids = [i for i, _ in self.logit_bias]
        if ids != sorted(set(ids)):
            raise SamplingParamsError("logit_bias: ids must be unique and sorted (use Penalties.with_bias)")
        for i, b in self.logit_bias:
            if isinstance(i, bool) or not isinstance(i, int) or i < 0:
                raise SamplingParamsError(f"logit_bias: {i!r} is not a token id")
            if isinstance(b, bool) or not isinstance(b, (int, float)) or not abs(b) <= MAX_LOGIT_BIAS:
                raise SamplingParamsError(
                    f"logit_bias[{i}]: must be a number in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {b!r} (past "
                    "float32's range the logit turns inf and the log-probs NaN; -1e6 bans an id as -inf would)"
                )

    @classmethod
    def with_bias(cls, frequency=0.0, presence=0.0, repetition=1.0, logit_bias: dict | None = None) -> Penalties:
        """From a ``{id: bias}`` mapping (keys may be strings, as in JSON); the last of duplicates wins."""
        bias = {}
        for key, value in (logit_bias or {}).items():
            try:
                bias[int(key)] = float(value)
            except (TypeError, ValueError):
                raise SamplingParamsError(f"logit_bias: {key!r} is not a token id") from None
        return cls(float(frequency), float(presence), float(repetition), tuple(sorted(bias.items())))

    @property
    def active(self) -> bool:
        return self.frequency != 0 or self.presence != 0 or self.repetition != 1 or bool(self.logit_bias)

    def check(self, semantics: str, vocab_size: int | None = None, where: str = "penalties") -> Penalties:
        if semantics == "hf" and (self.frequency or self.presence):
            raise SamplingParamsError(
                f"{where}: the hf semantics have no frequency or presence penalty (transformers has no such processor)"
            )
        if vocab_size is not None and self.logit_bias and self.logit_bias[-1][0] >= vocab_size:
            raise SamplingParamsError(
                f"{where}: logit_bias id {self.logit_bias[-1][0]} is outside the vocabulary [0, {vocab_size})"
            )
        return self

    def setting(self) -> str:
        """The penalties that are not neutral, for messages."""
        return ", ".join(f"{k}={v}" for k, v in self.to_json().items() if v not in (0.0, 1.0, {}))

    def to_json(self) -> dict:
        return {
            "frequency_penalty": self.frequency,
            "presence_penalty": self.presence,
            "repetition_penalty": self.repetition,
            "logit_bias": {str(i): b for i, b in self.logit_bias},
        }


NO_PENALTIES = Penalties()


@lru_cache(maxsize=64)
def _repeated_sum_table(value: float, size: int) -> np.ndarray:
    """``table[c]`` = ``value`` added ``c`` times in fp32, one addition at a time (SGLang's scatter_add):
    numpy's ``cumsum`` accumulates in order, in the array's dtype. ``size`` is a power of two
    (``repeated_sum`` rounds up), so a growing history rebuilds the table a logarithmic number of times."""
    return np.concatenate([np.zeros(1, np.float32), np.cumsum(np.full(size, value, np.float32), dtype=np.float32)])


def repeated_sum(value: float, counts: torch.Tensor) -> torch.Tensor:
    size = int(counts.max()) if counts.numel() else 0
    table = torch.from_numpy(_repeated_sum_table(float(value), 1 << max(size, 1).bit_length()))
    return table.to(counts.device)[counts.long()]


def penalise(
    z: torch.Tensor,
    out_counts: torch.Tensor,
    seen: torch.Tensor,
    bias: torch.Tensor | None,
    p: Penalties,
    semantics: str,
) -> torch.Tensor:
    """The penalised and biased logits, elementwise (any shape, fp32).

    ``out_counts``: occurrences of each id in the output history (integers); ``seen``: the id
    is in the repetition penalty's history (sglang: the output; vllm and hf: prompt or output);
    ``bias``: ``(values, biased)``, the logit bias of each id (zeros where none) and whether it
    has one, or None without a bias. Signed zeros follow the engines too: SGLang adds its
    accumulated additive tensor (zeros included) once any penalty is on, and its dense bias
    tensor; vLLM adds the bias at the biased ids only.
    """
    if semantics == "sglang":
        if p.frequency or p.presence or p.repetition != 1:
            acc = torch.zeros_like(z)
            if p.frequency:
                acc = acc - repeated_sum(p.frequency, out_counts)
            if p.presence:
                acc = acc - torch.where(
                    out_counts > 0,
                    torch.tensor(p.presence, dtype=z.dtype, device=z.device),
                    torch.zeros((), dtype=z.dtype, device=z.device),
                )
            z = z + acc
        if p.repetition != 1:
            r = torch.where(
                seen,
                torch.tensor(p.repetition, dtype=z.dtype, device=z.device),
                torch.ones((), dtype=z.dtype, device=z.device),
            )
            z = torch.where(z < 0, z * r, z / r)
        if bias is not None:
            z = z + bias[0]
        return z
    if semantics == "vllm":
        if bias is not None:
            z = torch.where(bias[1], z + bias[0], z)
        if p.frequency or p.presence or p.repetition != 1:
            r = torch.where(
                seen,
                torch.tensor(p.repetition, dtype=z.dtype, device=z.device),
                torch.ones((), dtype=z.dtype, device=z.device),
            )
            z = z * torch.where(z > 0, 1.0 / r, r)
            z = z - torch.tensor(p.frequency, dtype=z.dtype, device=z.device) * out_counts.to(z.dtype)
            z = z - torch.tensor(p.presence, dtype=z.dtype, device=z.device) * (out_counts > 0).to(z.dtype)
        return z
    if semantics == "hf":
        p.check("hf")
        if bias is not None:
            z = z + bias[0]
        if p.repetition != 1:
            penalised = torch.where(z < 0, z * p.repetition, z / p.repetition)
            z = torch.where(seen, penalised, z)
        return z
    raise SamplingParamsError(f"semantics: one of {SEMANTICS}, got {semantics!r}")


def repetition_history_includes_prompt(semantics: str) -> bool:
    return semantics in ("vllm", "hf")


# ---- dense rows (the engine) ------------------------------------------------------------


def dense_history(
    prompt_ids: list[int], output_ids: list[int], vocab: int, semantics: str, device=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out_counts[V], seen[V])`` of one request for ``penalise`` on a whole row."""
    out = torch.as_tensor(output_ids, dtype=torch.long, device=device)
    counts = (
        torch.bincount(out, minlength=vocab)[:vocab]
        if len(output_ids)
        else torch.zeros(vocab, dtype=torch.long, device=device)
    )
    seen = counts > 0
    if repetition_history_includes_prompt(semantics) and prompt_ids:
        seen = seen.clone()
        seen[torch.as_tensor(prompt_ids, dtype=torch.long, device=device)] = True
    return counts, seen


def dense_bias(p: Penalties, vocab: int, device=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(values[V], biased[V])`` of one request, or None without a bias."""
    if not p.logit_bias:
        return None
    bias = torch.zeros(vocab, dtype=torch.float32, device=device)
    ids, values = zip(*p.logit_bias)
    at = torch.tensor(ids, dtype=torch.long, device=device)
    bias[at] = torch.tensor(values, dtype=torch.float32, device=device)
    biased = torch.zeros(vocab, dtype=torch.bool, device=device)
    biased[at] = True
    return bias, biased


# ---- gathered rows (the trainer) -----------------------------------------------------------


def history_counts(
    sequences: torch.Tensor,
    lengths: torch.Tensor,
    rows_b: torch.Tensor,
    rows_pos: torch.Tensor,
    rows_start: torch.Tensor,
    ids: torch.Tensor,
    vocab: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Occurrences of the ids ``[N, K]`` in each row's histories, without a ``[N, V]`` tensor.

    ``sequences`` ``[B, L]`` token ids (prompt and response), ``lengths`` ``[B]``; row ``n``
    predicts position ``rows_pos[n]`` of sequence ``rows_b[n]``, whose engine request began its
    output at position ``rows_start[n]``. Returns ``(output counts, prompt counts)``: how often
    each id occurs in ``[start, pos)`` and in ``[0, start)``. Keys ``(b, id, position)`` are
    sorted once; each query is two binary searches.
    """
    B, L = sequences.shape
    pos = torch.arange(L, device=sequences.device)
    real = pos[None, :] < lengths[:, None]
    b_idx = torch.arange(B, device=sequences.device)[:, None].expand(B, L)
    span = L + 1
    keys = ((b_idx * vocab + sequences) * span + pos[None, :])[real].sort().values
    base = (rows_b[:, None] * vocab + ids) * span
    at = lambda p: torch.searchsorted(keys, base + p[:, None])  # noqa: E731  occurrences before position p
    first, start, here = at(torch.zeros_like(rows_pos)), at(rows_start), at(rows_pos)
    return here - start, start - first


def gathered_bias(p: Penalties, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(values, biased)`` of each id ``[N, K]``, by binary search in the sorted bias ids."""
    if not p.logit_bias:
        return None
    bias_ids = torch.tensor([i for i, _ in p.logit_bias], dtype=torch.long, device=ids.device)
    values = torch.tensor([b for _, b in p.logit_bias], dtype=torch.float32, device=ids.device)
    at = torch.searchsorted(bias_ids, ids).clamp(max=len(bias_ids) - 1)
    biased = bias_ids[at] == ids
    return torch.where(biased, values[at], torch.zeros((), dtype=torch.float32, device=ids.device)), biased
