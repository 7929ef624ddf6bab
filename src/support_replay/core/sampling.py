"""Sampling with an explicit filter semantics, capturing the realized support S_t and log mu.

Three semantics, each the filter of one engine family (docs/math.md, with the engine files each was read from):

- ``"sglang"``: softmax(z/T) in fp32, sort descending, inclusive cumsum on the
  *unfiltered* sorted probabilities; keep ranks < k (exactly k, by rank), drop tokens
  whose exclusive prefix mass exceeds top_p, then drop p < min_p * p_max.
- ``"vllm"``: temperature, min-p, top-k keeping every tie at the k-th value, then top-p
  judged on the distribution renormalised after those filters.
- ``"hf"``: Hugging Face warper order: temperature, top-k (ties kept), top-p on the
  renormalised distribution, then min-p. Computed with the same tensor operations as
  transformers' warpers, so the supports are identical.

Ties are broken by the lower token id wherever a semantics cuts by rank ("sglang"
ranks, "vllm" top-p), so the support is a deterministic function of the logits.
Whatever the semantics, S_t holds only tokens whose post-filter weight is > 0.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..errors import SamplingParamsError
from .logprobs import support_logprobs
from .support import SupportTable, offsets_from_sizes

SEMANTICS = ("sglang", "vllm", "hf")
TIE_ROOM = 16  # values past the top-k cut its selection takes too: a bf16 tie at the cut mostly ends inside them


MIN_TEMPERATURE = 1e-6  # SGLang 0.5.23's _SAMPLING_EPS (sampling_params.py): below it SGLang decodes greedily


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. ``top_k=-1`` and ``top_p=1`` and ``min_p=0`` disable a filter.

    ``temperature=0`` means greedy decoding and is only allowed without filters
    (replay needs a positive temperature to score the actor).
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def __post_init__(self):
        t, k, p, mp = self.temperature, self.top_k, self.top_p, self.min_p
        if not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise SamplingParamsError(f"temperature: must be a finite number >= 0, got {t!r}")
        if 0 < t < MIN_TEMPERATURE:
            raise SamplingParamsError(
                f"temperature: {t!r} is below {MIN_TEMPERATURE:g} (logits / T overflow float32 and the log-probs turn "
                "NaN; SGLang samples greedily below it): ask for 0, greedy, or a larger temperature"
            )
        if isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or k >= 1):
            raise SamplingParamsError(f"top_k: must be -1 (disabled) or an integer >= 1, got {k!r}")
        if not isinstance(p, (int, float)) or not (0 < p <= 1):
            raise SamplingParamsError(f"top_p: must be in (0, 1], got {p!r}")
        if not isinstance(mp, (int, float)) or not (0 <= mp <= 1):
            raise SamplingParamsError(f"min_p: must be in [0, 1], got {mp!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64
        ):
            raise SamplingParamsError(f"seed: must be None or an integer in [0, 2**64), got {self.seed!r}")
        if t == 0 and self.replay_active:
            raise SamplingParamsError(
                f"temperature: must be > 0 when a support filter is active (top_k={k}, top_p={p}, min_p={mp}); "
                "replay divides the actor logits by the rollout temperature"
            )

    @property
    def replay_active(self) -> bool:
        """True when a truncation filter makes the sampled policy differ from softmax(z/T)."""
        return self.top_p < 1 or self.top_k > 0 or self.min_p > 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class SampledTokens:
    """One token per row and, for the captured rows, their realized support and log mu."""

    tokens: torch.Tensor  # [B] int64, on the logits' device
    support: SupportTable  # host CSR, one row per captured row, ids ascending
    log_mu: torch.Tensor  # [C] fp32, log mu(a_t | s_t, S_t) of the captured rows
    captured: torch.Tensor  # [C] int64: which rows were captured (all of them by default)


def _per_row(params, rows: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * rows
    params = list(params)
    if len(params) != rows:
        raise SamplingParamsError(f"params: {len(params)} sampling settings for {rows} rows")
    for i, p in enumerate(params):
        if not isinstance(p, SamplingParams):
            raise SamplingParamsError(f"params[{i}]: expected SamplingParams, got {type(p).__name__}")
    return params


def _columns(params: list[SamplingParams], vocab: int, device):
    """``(T, top_k, top_p, min_p)``, ``[B, 1]`` each; a batch's settings repeat from step to step, so the last few
    batches' columns are kept (read only: no caller writes them)."""
    return _cached_columns(tuple(params), vocab, torch.device(device))


@functools.lru_cache(maxsize=16)
def _cached_columns(params: tuple[SamplingParams, ...], vocab: int, device: torch.device):
    def col(values, dtype):
        return torch.tensor(values, dtype=dtype, device=device)[:, None]

    temp = col([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32)
    top_k = col([min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params], torch.long)
    # float64 so that each semantics can round 1 - top_p the way its engine does
    top_p = col([p.top_p for p in params], torch.float64)
    min_p = col([p.min_p for p in params], torch.float32)
    return temp, top_k, top_p, min_p


def _keep_sglang(probs_sort, top_k, top_p, min_p):
    """SGLang's rule on probabilities sorted descending (ties by lower id)."""
    ranks = torch.arange(probs_sort.shape[-1], device=probs_sort.device)[None, :]
    exclusive = probs_sort.cumsum(dim=-1) - probs_sort
    keep = ranks < top_k
    keep &= (exclusive <= top_p.float()) | (top_p >= 1)
    keep &= probs_sort >= min_p * probs_sort[:, :1]
    keep &= probs_sort > 0
    return keep


def _top_candidates(probs, width: int, select=None):
    """At least the ``width`` largest probabilities of every row, ordered (prob desc, id asc):
    the full sort's first ``width`` entries of every row, and in the same order.

    ``select(probs, width)``, where given, returns exactly those entries (a compiled kernel: the engine's
    kernels/top_candidates.py) or None where it does not run; else the selection is torch.topk's, as follows.

    A tie that straddles the cut (frequent with bf16 logits) widens the selection to every id
    tied with the ``width``-th largest value, so the ids beyond the cut that the tie order
    brings in are there too: from the first selection's ``TIE_ROOM`` extra values when every
    row's tie ends inside them, else from a second, wider one. None when that is not narrower
    than a quarter of the vocabulary.
    """
    vocab = probs.shape[-1]
    if width + 1 >= vocab:
        return None
    selected = None if select is None else select(probs, width)
    if selected is not None:
        return selected
    vals, idx = torch.topk(probs, min(vocab, width + TIE_ROOM), dim=-1)
    cut = vals[:, width - 1 : width]
    if bool((vals[:, width : width + 1] == cut).any()):
        # every id at or above each row's cut value (count_nonzero: sum would widen a [B, V] mask to int64)
        if bool((vals[:, -1:] < cut).all()):  # each row's last value is below its cut: the ties are all here
            wide = int((vals >= cut).count_nonzero(-1).max())
        else:
            wide = int((probs >= cut).count_nonzero(-1).max())
            if wide * 4 > vocab:
                return None
            vals, idx = torch.topk(probs, wide, dim=-1)
        vals, idx = vals[:, :wide], idx[:, :wide]
    else:
        vals, idx = vals[:, :width], idx[:, :width]
    by_id = idx.argsort(dim=-1)
    vals, idx = vals.gather(1, by_id), idx.gather(1, by_id)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(1, order), idx.gather(1, order)


def _narrow(width: int, vocab: int) -> bool:
    """Whether SGLang's rule reads a top-k selection of ``width`` ranks instead of the full sort (a quarter of the
    vocabulary at most, and short of all of it)."""
    return width * 4 <= vocab and width + 1 < vocab


def _ranked_sglang(probs, top_k, top_p, min_p, select=None):
    """``(keep, order, narrow)``: SGLang's rule over the ranks of the full sort (prob desc, id asc); ``narrow``
    when they are only the first max top_k ranks. Every row keeps at most its top_k ranks, so those decide
    everything: a top-k selection replaces the full sort when it is narrow."""
    width = int(top_k.max())
    candidates = _top_candidates(probs, width, select) if _narrow(width, probs.shape[-1]) else None
    if candidates is not None:
        probs_sort, order = candidates
    else:
        probs_sort, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    return _keep_sglang(probs_sort, top_k, top_p, min_p), order, candidates is not None


def _mask_of_ranks(keep: torch.Tensor, order: torch.Tensor, vocab: int) -> torch.Tensor:
    """The ``[B, vocab]`` mask that ``keep`` over the ids ``order`` stands for."""
    return torch.zeros(keep.shape[0], vocab, dtype=torch.bool, device=keep.device).scatter_(1, order, keep)


def _mask_sglang(y, probs, top_k, top_p, min_p, select=None):
    keep, order, _ = _ranked_sglang(probs, top_k, top_p, min_p, select)
    return _mask_of_ranks(keep, order, y.shape[-1])


def _mask_vllm(y, probs, top_k, top_p, min_p, select=None):
    del select  # vLLM's rule renormalises after min-p and top-k: it reads the whole sort
    keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)
    y = y.masked_fill(~keep, float("-inf"))
    y_sort, order = torch.sort(y, dim=-1, descending=False, stable=True)
    kth = y_sort.gather(1, y.shape[-1] - top_k)
    y_sort = y_sort.masked_fill(y_sort < kth, float("-inf"))
    cum = torch.softmax(y_sort, dim=-1).cumsum(dim=-1)
    drop = (cum <= 1 - top_p.float()) & (top_p < 1)  # vLLM: p is an fp32 tensor
    drop[:, -1] = False
    y_sort = y_sort.masked_fill(drop, float("-inf"))
    keep_sorted = torch.softmax(y_sort, dim=-1) > 0
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def _mask_hf(y, probs, top_k, top_p, min_p, select=None):
    del probs, select  # the warpers renormalise their own processed scores, over the whole sort
    # The exact operations of TopK-, TopP- and MinPLogitsWarper, batched with per-row settings.
    rows = y.shape[0]
    inf = float("-inf")
    kth = torch.sort(y, dim=-1, descending=True).values.gather(1, top_k - 1)
    y = y.masked_fill(y < kth, inf)
    sorted_logits, sorted_idx = torch.sort(y, descending=False)
    cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cum <= (1 - top_p).float()  # HF: 1 - top_p in Python floats, then fp32
    drop[..., -1:] = 0
    drop &= top_p < 1
    y = y.masked_fill(drop.scatter(1, sorted_idx, drop), inf)
    probs = torch.softmax(y, dim=-1)
    remove = probs < min_p * probs.amax(dim=-1, keepdim=True)
    remove.scatter_(-1, torch.topk(probs, 1, dim=-1).indices, False)
    remove &= min_p > 0
    y = y.masked_fill(remove, inf)
    return (torch.softmax(y, dim=-1) > 0).reshape(rows, -1)


_MASKS = {"sglang": _mask_sglang, "vllm": _mask_vllm, "hf": _mask_hf}


def _check_inputs(logits: torch.Tensor, semantics: str) -> None:
    if semantics not in _MASKS:
        raise SamplingParamsError(f"semantics: must be one of {SEMANTICS}, got {semantics!r}")
    if logits.ndim != 2 or logits.shape[1] == 0:
        raise SamplingParamsError(f"logits: expected [B, V] with V > 0, got shape {tuple(logits.shape)}")


def _scaled(logits: torch.Tensor, plist: list[SamplingParams]):
    """``(z / T [B, V] float32, softmax of it, the filters' columns)``, the softmax computed once."""
    temp, top_k, top_p, min_p = _columns(plist, logits.shape[1], logits.device)
    # z / 1 is z exactly: at temperature 1 (a GRPO rollout's) the pass over [B, V] is skipped, the bits unchanged
    y = logits.float() if all(p.temperature in (0, 1) for p in plist) else logits.float() / temp
    return y, torch.softmax(y, dim=-1), (temp, top_k, top_p, min_p)


def _support(logits: torch.Tensor, plist: list[SamplingParams], semantics: str, select=None):
    """``(mask [B, V], softmax(z/T) [B, V], T [B, 1], greedy [B])``."""
    y, probs, (temp, top_k, top_p, min_p) = _scaled(logits, plist)
    mask = _MASKS[semantics](y, probs, top_k, top_p, min_p, select)
    greedy = torch.tensor([p.greedy for p in plist], device=logits.device)
    if bool(greedy.any()):
        argmax = torch.zeros_like(mask).scatter_(1, logits.argmax(-1, keepdim=True), True)
        mask = torch.where(greedy[:, None], argmax, mask)
    return mask, probs, temp, greedy


def _support_rows(logits: torch.Tensor, plist: list[SamplingParams], semantics: str, select=None):
    """``((ids, valid, cols, counts), softmax(z/T), T, greedy)``: the support in ``_padded_rows``' form. SGLang's
    rule over a narrow top-k selection, without a greedy row, builds it from the kept ranks alone: no ``[B, V]``
    mask and no pass of nonzero over one."""
    if semantics == "sglang" and not any(p.greedy for p in plist):
        _, probs, (temp, top_k, top_p, min_p) = _scaled(logits, plist)
        greedy = torch.zeros(len(plist), dtype=torch.bool, device=logits.device)
        rows = _compiled_rows(probs, top_k, top_p, min_p, select)
        if rows is not None:
            return rows, probs, temp, greedy
        keep, order, narrow = _ranked_sglang(probs, top_k, top_p, min_p, select)
        if narrow:
            return _rows_of_ranks(keep, order, logits.shape[1]), probs, temp, greedy
        return _padded_rows(_mask_of_ranks(keep, order, logits.shape[1])), probs, temp, greedy
    mask, probs, temp, greedy = _support(logits, plist, semantics, select)
    return _padded_rows(mask), probs, temp, greedy


def _compiled_draw(logits: torch.Tensor, plist: list[SamplingParams], semantics: str, generator, select):
    """``((ids, valid, cols, counts), softmax(z/T), T, greedy, tokens)``: ``_support_rows`` and the draw in one call of
    ``select.sglang_draw`` (the engine's compiled kernel, checked against the operations below), where it has one and
    takes the batch: SGLang's rule over a narrow selection, no greedy row, a generator of each row's own; else None.
    Where it also has ``sglang_draw_logits`` (float32 logits) the softmax is that call's too, row by row with the
    selection (~0.2 of a 2.3 ms sampling step inside a GRPO-shape decode of SmolLM2 on a Zen 5 EPYC)."""
    draw = getattr(select, "sglang_draw", None)
    if draw is None or semantics != "sglang" or any(p.greedy for p in plist):
        return None
    if not isinstance(generator, (list, tuple)) or not all(isinstance(g, torch.Generator) for g in generator):
        return None
    if len(generator) != len(plist) or not all(g.device == logits.device for g in generator):
        return None
    temp, top_k, top_p, min_p = _columns(plist, logits.shape[1], logits.device)
    width = int(top_k.max())
    if not _narrow(width, logits.shape[-1]):
        return None
    greedy = torch.zeros(len(plist), dtype=torch.bool, device=logits.device)
    # the softmax with the selection, row by row (``select.sglang_draw_logits``, checked against ``_scaled``'s)
    fused = getattr(select, "sglang_draw_logits", None)
    drawn = None if fused is None else fused(logits, width, temp, top_k, top_p, min_p, list(generator))
    if drawn is not None:
        return drawn[:4], drawn[5], temp, greedy, drawn[4]
    _, probs, _ = _scaled(logits, plist)
    drawn = draw(probs, width, top_k, top_p, min_p, list(generator))
    if drawn is None:
        return None
    return drawn[:4], probs, temp, greedy, drawn[4]


def _compiled_rows(probs, top_k, top_p, min_p, select):
    """``_rows_of_ranks`` of SGLang's rule over a narrow selection in one call of ``select.sglang_rows`` (the engine's
    compiled kernel, checked against ``_keep_sglang`` and ``_rows_of_ranks``), where it has one and takes the call."""
    rows_of = getattr(select, "sglang_rows", None)
    width, vocab = int(top_k.max()), probs.shape[-1]
    if rows_of is None or not _narrow(width, vocab):
        return None
    return rows_of(probs, width, top_k, top_p, min_p)


def support_mask(logits: torch.Tensor, params, semantics: str = "sglang") -> torch.Tensor:
    """Boolean ``[B, V]``: the realized support of every row under ``semantics``.

    ``params`` is one ``SamplingParams`` for the batch or one per row. Greedy rows
    (temperature 0) get the singleton ``{argmax}``.
    """
    _check_inputs(logits, semantics)
    return _support(logits, _per_row(params, logits.shape[0]), semantics)[0]


def _exponential_noise(shape, generator, device, counts: list[int]) -> torch.Tensor:
    """Exp(1) noise; argmax(w / noise) draws a token with probability proportional to w. With one
    generator per row, row i draws exactly ``counts[i]`` values (its own support's size, not the
    batch's widest), so a request's tokens do not depend on its neighbours."""
    rows = shape[0]
    if generator is None or isinstance(generator, torch.Generator):
        return torch.empty(shape, device=device).exponential_(generator=generator).clamp_min_(1e-30)
    generators = list(generator)
    if len(generators) != rows:
        raise SamplingParamsError(f"generator: {len(generators)} generators for {rows} rows")
    noise = torch.ones(shape, device=device)  # padding columns weigh 0 whatever their noise
    for i, g in enumerate(generators):
        noise[i, : counts[i]].exponential_(generator=g)
    noise.clamp_min_(1e-30)  # a zero draw would turn w / noise into inf or nan
    return noise


def _padded_rows(mask: torch.Tensor):
    """``(ids[C, K], valid[C, K], cols, counts)`` of a boolean mask, ids ascending in every row.

    ``cols`` (the ids of all rows, row after row) and ``counts`` are the CSR form of the
    same support; the padded form feeds ``support_logprobs`` on the mask's own device, in
    exactly the layout ``SupportTable.to_padded`` gives the trainer.
    """
    rows, cols = torch.nonzero(mask, as_tuple=True)
    # from the nonzero rows, not mask.sum(-1): that widens the whole [B, V] mask to int64 first
    counts = torch.bincount(rows, minlength=mask.shape[0])
    width = int(counts.max()) if counts.numel() else 0
    starts = torch.cumsum(counts, 0) - counts
    within = torch.arange(len(cols), device=mask.device) - starts[rows]
    ids = torch.zeros(mask.shape[0], max(width, 1), dtype=torch.long, device=mask.device)
    ids[rows, within] = cols
    valid = torch.arange(ids.shape[1], device=mask.device)[None, :] < counts[:, None]
    return ids, valid, cols, counts


def _rows_of_ranks(keep: torch.Tensor, order: torch.Tensor, vocab: int):
    """``_padded_rows`` of the mask that ``keep`` ``[B, W]`` over the ids ``order`` ``[B, W]`` stands for: the same
    tensors, from the ``W`` ranks alone."""
    counts = keep.sum(-1)
    width = max(int(counts.max()) if counts.numel() else 0, 1)
    # the kept ids ascending, every dropped one past them (the vocabulary size sorts last)
    ids = order.masked_fill(~keep, vocab).sort(dim=-1).values[:, :width]
    valid = torch.arange(width, device=keep.device)[None, :] < counts[:, None]
    ids = ids.masked_fill_(~valid, 0)
    return ids, valid, ids[valid], counts


def sample_tokens(
    logits: torch.Tensor, params, semantics: str = "sglang", generator=None, capture=True, select=None
) -> SampledTokens:
    """Sample one token per row and capture ``(S_t, log mu)``.

    ``generator`` is None, one ``torch.Generator`` for the batch, or one per row.
    ``capture`` is True, False or one flag per row: rows without it (evaluation requests)
    are sampled with the same filter but build no support table and no log mu.
    ``log_mu`` comes from ``support_logprobs``, the function the trainer scores with, on
    the same padded layout; the support leaves the device once, as CSR. ``select``: the top-k selection
    SGLang's rule may take instead of torch.topk (``_top_candidates``; the same support).
    """
    _check_inputs(logits, semantics)
    rows, vocab = logits.shape
    plist = _per_row(params, rows)
    drawn = _compiled_draw(logits, plist, semantics, generator, select)
    if drawn is not None:
        (ids, valid, cols, counts), probs, temp, greedy, tokens = drawn
    else:
        (ids, valid, cols, counts), probs, temp, greedy = _support_rows(logits, plist, semantics, select)
    if capture is True:  # every row (the default): no flags to read
        captured = torch.arange(rows)
    else:
        flags = (
            torch.full((rows,), capture) if isinstance(capture, bool) else torch.as_tensor(capture, dtype=torch.bool)
        )
        if flags.shape != (rows,):
            raise SamplingParamsError(f"capture: expected a bool or {rows} flags, got shape {tuple(flags.shape)}")
        captured = flags.nonzero().squeeze(1)
    if drawn is None:
        # the draw runs on the padded support rows [B, K], not on [B, V]: past the filter, no pass over the vocabulary
        weights = probs.gather(1, ids).masked_fill_(~valid, 0.0)
        noise = _exponential_noise(tuple(ids.shape), generator, logits.device, counts.tolist())
        tokens = ids.gather(1, (weights / noise).argmax(dim=-1, keepdim=True)).squeeze(1)
        if any(p.greedy for p in plist):
            tokens = torch.where(greedy, logits.argmax(-1), tokens)
    scored, scored_tokens, scored_temp = logits, tokens, temp.squeeze(1)
    if len(captured) < rows:  # evaluation rows: no support table, no log mu
        index = captured.to(logits.device)
        ids, valid, counts = ids[index], valid[index], counts[index]
        cols = ids[valid]
        scored, scored_tokens, scored_temp = logits[index], tokens[index], scored_temp[index]
    with torch.no_grad():
        log_mu = support_logprobs(scored, scored_tokens, (ids, valid), scored_temp)
    offsets = offsets_from_sizes(counts.cpu().numpy())
    support = SupportTable(cols.to(torch.int32).cpu().numpy(), offsets)
    return SampledTokens(tokens=tokens, support=support, log_mu=log_mu, captured=captured)
