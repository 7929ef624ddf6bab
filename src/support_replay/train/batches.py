"""How a rollout's samples are cut into optimizer steps and micro-batches, built once per rollout.

Every scoring pass of a rollout (old policy, reference, the update itself) runs on the same
micro-batches, so a token is scored by the same function on the same batch every time:
before the first optimizer step its old and new log-probs are equal bit for bit. The
support of a micro-batch is padded once, onto the trainer's device, when the plan is made.

Layout: each optimizer step takes ``global_batch`` consecutive samples (the last step fewer when
agent episodes split into more samples than episodes), sorted longest first
so that a micro-batch pads its samples to similar lengths; each rank takes a contiguous
share; each share is cut into micro-batches of ``micro_batch`` samples, or by a token budget
(``--max-tokens-per-micro-batch``: as many samples as fit that many padded tokens, so short
responses travel many to a batch and long ones few, the same count on every rank). With as
many micro-batches per rank as one process has in all, the ranks compute exactly the
micro-batches one process would.

Packed (``--packed-scoring``): the samples of one prompt (a GRPO group) are planned together and
scored as one row, the prompt once and every response after it, each response attending to the
prompt and to itself (``build_packed_micro_batch``): a group of 4 with a 44-token prompt and
35-token answers is 184 tokens instead of 4 x 79 = 316, with no padding inside the row.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..core.penalties import Penalties, gathered_bias, history_counts, penalise, repetition_history_includes_prompt
from ..core.routing import FREE
from ..core.support import SupportTable
from ..errors import SampleError
from ..rollout.sample import Sample, routing_segments


@dataclass
class PenaltyRows:
    """The rollout's penalties and logit bias at every support id of a micro-batch, over each
    row's own history (docs/math.md): counted once when the batch is planned, applied on every
    scoring pass as the ``transform`` of ``penalised_support_logprobs``."""

    penalties: Penalties
    semantics: str  # whose rules: the engine's that sampled
    out_counts: torch.Tensor  # [N, K] occurrences of each support id in the row's output history
    seen: torch.Tensor  # [N, K] the id is in the repetition penalty's history
    bias: tuple[torch.Tensor, torch.Tensor] | None

    def __call__(self, z: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return penalise(z, self.out_counts, self.seen, self.bias, self.penalties, self.semantics)


def penalty_rows(
    p: Penalties, semantics: str, input_ids, attention_mask, rows_b, rows_pos, rows_start, ids
) -> PenaltyRows:
    vocab = int(max(int(input_ids.max()), int(ids.max()))) + 1  # any bound above every id keeps the keys apart
    out, before = history_counts(input_ids, attention_mask.sum(1), rows_b, rows_pos, rows_start, ids, vocab)
    seen = (out > 0) | (before > 0) if repetition_history_includes_prompt(semantics) else out > 0
    return PenaltyRows(p, semantics, out, seen, gathered_bias(p, ids))


@dataclass
class MicroBatch:
    """One forward/backward: right-padded sequences and the rows that score response tokens."""

    indices: list[int]  # sample indices, in the order of the rows below
    lengths: list[int]  # response tokens per sample
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L] long, or [B, 1, L, L] bool when packed (True: the query sees the key)
    rows_b: torch.Tensor  # [N] batch row of every scored position
    rows_t: torch.Tensor  # [N] position whose logits predict response token n
    targets: torch.Tensor  # [N] the response tokens
    support: tuple[torch.Tensor, torch.Tensor] | None  # padded (ids [N, K], valid [N, K]) under replay
    loss_mask: torch.Tensor  # [N] float, 1 for tokens that train
    penalty: PenaltyRows | None = None  # the rollout's penalties at the support ids, when it had any
    position_ids: torch.Tensor | None = None  # [B, L] when packed: every response continues its prompt's positions
    # [B, L] when packed: -1 the prompt, j response j, -2 padding (the batch-invariant attention's layout)
    segments: torch.Tensor | None = None
    # [B, L, layers, top_k] the engine's experts at every input position (routing replay; FREE: route freely)
    routing: torch.Tensor | None = None
    # [N, K] the sampler's log q of every support id, laid out like ``support`` (score centering)
    sampler_support_logp: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.targets)

    def split(self, values: torch.Tensor) -> list[torch.Tensor]:
        """Flat per-token values back into one tensor per sample."""
        return list(torch.split(values, self.lengths))


@dataclass
class OptimizerStep:
    """The micro-batches this rank runs for one optimizer step, and the step's normalisers."""

    micro_batches: list[MicroBatch]
    tokens: int  # trained tokens in the whole global batch (every rank)
    sequences: int  # samples with at least one trained token in the whole global batch


def prompt_groups(samples: list[Sample], part: list[int]) -> list[list[int]]:
    """``part``'s samples grouped by identical prompt tokens (and, under routing replay, identical
    prompt routing), in order of first appearance: the rows of a packed micro-batch."""
    rows: dict[tuple, list[int]] = {}
    for i in part:
        s = samples[i]
        # routing replay: the prompt is computed once per row, so its samples must have routed it alike
        routed = s.routing[: len(s.prompt_ids)].tobytes() if s.routing is not None else b""
        rows.setdefault((tuple(s.prompt_ids), routed), []).append(i)
    return list(rows.values())


def _packed_length(samples: list[Sample], row: list[int]) -> int:
    return len(samples[row[0]].prompt_ids) + sum(samples[i].response_length for i in row)


def build_packed_micro_batch(samples: list[Sample], indices: list[int], replay: bool, device) -> MicroBatch:
    """One row per distinct prompt: the prompt once, then each response after it. A response
    attends to the prompt and to its own earlier tokens only, at the positions it had alone, so
    every score and gradient is the unpacked one's math; the prompt is computed once per group.
    The batch's ``indices`` list the samples grouped by prompt, the order ``split`` returns them in."""
    rows = prompt_groups(samples, indices)
    indices = [
        i for row in rows for i in row
    ]  # the scored rows' order (the planner's already, when it planned for packing)
    width = max(_packed_length(samples, row) for row in rows)
    # routing replay: a row more for each earlier computation's tokens, its prompt and response up to its last one
    extra = [(i, segment) for i in indices for segment in _segments(samples[i])]
    height = len(rows) + len(extra)
    ids = torch.zeros(height, width, dtype=torch.long)
    positions = torch.zeros(height, width, dtype=torch.long)
    segment = torch.full((height, width), -2, dtype=torch.long)  # -1: the prompt, j >= 0: response j, -2: padding
    rows_b, rows_t, first = [], [], {}
    packed = [(samples[row[0]].prompt_ids, [(i, samples[i].response_ids) for i in row]) for row in rows]
    packed += [(samples[i].prompt_ids, [(i, samples[i].response_ids[:end])]) for i, (_, end, _) in extra]
    at_row = {}  # (sample, row) -> where its response begins in that row
    for b, (prompt, responses) in enumerate(packed):
        n = len(prompt)
        ids[b, :n] = torch.tensor(prompt)
        positions[b, :n] = torch.arange(n)
        segment[b, :n] = -1
        at = n
        for j, (i, response) in enumerate(responses):
            r = len(response)
            ids[b, at : at + r] = torch.tensor(response)
            positions[b, at : at + r] = torch.arange(n, n + r)
            segment[b, at : at + r] = j
            at_row[i, b] = at
            if b < len(rows):
                first[i] = len(rows_b)
                rows_b += [b] * r
                rows_t += ([n - 1] + list(range(at, at + r - 1)))[
                    :r
                ]  # the first token is predicted by the prompt's last position
            at += r
    for b, (i, (start, end, _)) in enumerate(extra, start=len(rows)):
        n, at = len(samples[i].prompt_ids), at_row[i, b]
        rows_b[first[i] + start : first[i] + end] = [b] * (end - start)
        rows_t[first[i] + start : first[i] + end] = ([n - 1] + list(range(at, at + end - 1)))[start:end]
    chosen = [samples[i] for i in indices]
    routing = _packed_routing(samples, rows, extra, width) if _routed(chosen) else None
    return MicroBatch(
        routing=None if routing is None else routing.to(device),
        indices=list(indices),
        input_ids=ids.to(device),
        attention_mask=_packed_attention(segment)[:, None].to(device),
        rows_b=torch.tensor(rows_b, dtype=torch.long, device=device),
        rows_t=torch.tensor(rows_t, dtype=torch.long, device=device),
        position_ids=positions.to(device),
        segments=segment.to(device),
        **_token_fields(chosen, replay, device),
    )


def _packed_attention(segment: torch.Tensor) -> torch.Tensor:
    """``[B, L, L]``: a query sees the keys of its row's prompt and of its own response before it."""
    width = segment.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    q_seg, k_seg = segment[:, :, None], segment[:, None, :]
    sees = causal & (((k_seg == -1) & (q_seg != -2)) | ((q_seg == k_seg) & (q_seg >= 0)))
    return sees | torch.eye(width, dtype=torch.bool)  # a padding position sees itself: no row of the softmax is empty


def _packed_routing(samples: list[Sample], rows: list[list[int]], extra: list, width: int) -> torch.Tensor:
    """The packed rows' experts: each prompt's once, then each response's; then the earlier computations' rows."""
    routing = _free_routing(samples[rows[0][0]], len(rows) + len(extra), width)
    for b, (_, (_, _, earlier)) in enumerate(extra, start=len(rows)):
        routing[b, : len(earlier)] = torch.from_numpy(earlier)
    for b, row in enumerate(rows):
        first = samples[row[0]]
        n = len(first.prompt_ids)
        routing[b, :n] = torch.from_numpy(first.routing[:n])
        at = n
        for i in row:
            s = samples[i]
            routed = s.routing[n : n + s.response_length]  # the last response token's row is FREE
            routing[b, at : at + len(routed)] = torch.from_numpy(routed)
            at += s.response_length
    return routing


def _row_routing(chosen: list[Sample], extra: list, width: int) -> torch.Tensor:
    """The unpacked rows' experts: each sample's, then the earlier computations' rows."""
    routing = _free_routing(chosen[0], len(chosen) + len(extra), width)
    for b, s in enumerate(chosen):
        routing[b, : len(s.routing)] = torch.from_numpy(s.routing)
    for row, (_, (_, _, earlier)) in enumerate(extra, start=len(chosen)):
        routing[row, : len(earlier)] = torch.from_numpy(earlier)
    return routing


def build_micro_batch(
    samples: list[Sample],
    indices: list[int],
    replay: bool,
    device,
    penalty_semantics: str = "sglang",
    pack: bool = False,
) -> MicroBatch:
    if pack:
        if samples[indices[0]].penalties.active:  # refused by the run config; a guard for direct callers
            raise SampleError(
                f"samples {indices}: packed scoring does not replay penalties (their history is one sequence per row)"
            )
        return build_packed_micro_batch(samples, indices, replay, device)
    chosen = [samples[i] for i in indices]
    width = max(len(s.prompt_ids) + s.response_length for s in chosen)
    # routing replay: a row more for each earlier computation's tokens, the sequence up to its last one
    extra = [(b, segment) for b, s in enumerate(chosen) for segment in _segments(s)]
    ids = torch.zeros(len(chosen) + len(extra), width, dtype=torch.long)
    mask = torch.zeros(len(chosen) + len(extra), width, dtype=torch.long)
    rows_b, rows_t, rows_start, first = [], [], [], []
    for b, s in enumerate(chosen):
        seq = s.prompt_ids + s.response_ids
        ids[b, : len(seq)] = torch.tensor(seq)
        mask[b, : len(seq)] = 1
        first.append(len(rows_b))
        rows_b += [b] * s.response_length
        rows_t += range(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + s.response_length)
        rows_start += output_starts(s)
    for row, (b, (start, end, _)) in enumerate(extra, start=len(chosen)):
        n = len(chosen[b].prompt_ids) + end
        ids[row, :n], mask[row, :n] = ids[b, :n], 1
        rows_b[first[b] + start : first[b] + end] = [row] * (end - start)
    if any(s.penalties != chosen[0].penalties for s in chosen):  # one transform per micro-batch
        raise SampleError(f"samples {indices}: sampled with different penalties; a run replays one setting")
    penalty = None
    ids, mask = ids.to(device), mask.to(device)
    rows_b, rows_t = (
        torch.tensor(rows_b, dtype=torch.long, device=device),
        torch.tensor(rows_t, dtype=torch.long, device=device),
    )
    fields = _token_fields(chosen, replay, device)
    if replay and chosen[0].penalties.active:
        starts = torch.tensor(rows_start, dtype=torch.long, device=device)
        penalty = penalty_rows(
            chosen[0].penalties, penalty_semantics, ids, mask, rows_b, rows_t + 1, starts, fields["support"][0]
        )
    routing = _row_routing(chosen, extra, width).to(device) if _routed(chosen) else None
    return MicroBatch(
        routing=routing,
        indices=list(indices),
        input_ids=ids,
        attention_mask=mask,
        rows_b=rows_b,
        rows_t=rows_t,
        penalty=penalty,
        **fields,
    )


def _segments(s: Sample) -> list[tuple[int, int, np.ndarray]]:
    """Routing replay: the earlier computations of ``s`` whose tokens need a forward of their own."""
    return routing_segments(s) if s.routing is not None else []


def _routed(chosen: list[Sample]) -> bool:
    """Whether the batch replays routing: its samples carry it (the run's checks demand all or none)."""
    return chosen[0].routing is not None


def _free_routing(first: Sample, rows: int, width: int) -> torch.Tensor:
    """``[rows, width, layers, top_k]`` of FREE: every position routes itself until a capture fills it."""
    return torch.full((rows, width, *first.routing.shape[1:]), FREE, dtype=torch.long)


def _token_fields(chosen: list[Sample], replay: bool, device) -> dict:
    """What a micro-batch holds per response token, samples in order, in either layout: the
    lengths, targets and loss mask, and under replay the support, padded once onto the
    trainer's device (the one padding on the trainer's side)."""
    table = SupportTable.concat([s.support for s in chosen]) if replay else None
    logq = None
    if replay and all(s.support_logq is not None for s in chosen):  # score centering: the sampler's log q
        logq = table.padded_values(np.concatenate([s.support_logq for s in chosen]), device)
    return dict(
        lengths=[s.response_length for s in chosen],
        targets=torch.tensor([t for s in chosen for t in s.response_ids], dtype=torch.long, device=device),
        support=table.to_padded(device=device) if replay else None,
        loss_mask=torch.from_numpy(np.concatenate([s.loss_mask for s in chosen]).astype(np.float32)).to(device),
        sampler_support_logp=logq,
    )


def output_starts(s: Sample) -> list[int]:
    """Per response token: the sequence position where its engine request began its output (a
    session's turns are separate requests; the penalties' output history restarts at each)."""
    starts = sorted(set(s.output_starts) | {0})
    out, k = [], 0
    for t in range(s.response_length):
        while k + 1 < len(starts) and starts[k + 1] <= t:
            k += 1
        out.append(len(s.prompt_ids) + starts[k])
    return out


def plan_optimizer_steps(
    samples: list[Sample],
    *,
    global_batch: int,
    micro_batch: int,
    rank: int,
    world: int,
    replay: bool,
    device,
    penalty_semantics: str = "sglang",
    max_tokens: int | None = None,
    pack: bool = False,
) -> list[OptimizerStep]:
    """This rank's micro-batches for every optimizer step of the rollout: ``micro_batch`` samples
    each, or under ``max_tokens`` as many as fit that many padded tokens (``token_budget_split``).
    ``pack``: the samples of a prompt stay together, scored as one packed row per prompt."""
    steps = []
    for start in range(0, len(samples), global_batch):
        batch = _longest_first(samples, range(start, min(start + global_batch, len(samples))), pack)
        per_rank = -(-len(batch) // world)
        shares = [batch[r * per_rank : (r + 1) * per_rank] for r in range(world)]
        if max_tokens is None:
            parts = [shares[rank][m : m + micro_batch] for m in range(0, len(shares[rank]), micro_batch)]
        else:
            parts = token_budget_split(samples, shares, max_tokens, pack)[rank]
        masks = [samples[i].loss_mask for i in batch]
        steps.append(
            OptimizerStep(
                micro_batches=[
                    build_micro_batch(samples, part, replay, device, penalty_semantics, pack) for part in parts
                ],
                tokens=int(sum(m.sum() for m in masks)),
                sequences=int(sum(m.any() for m in masks)),
            )
        )
    return steps


def _longest_first(samples: list[Sample], batch, pack: bool) -> list[int]:
    """Longest first, so that a micro-batch pads its rows to similar lengths; packed, by the
    length of the prompt's packed row, its samples together (longest first within)."""
    own = {i: len(samples[i].prompt_ids) + samples[i].response_length for i in batch}
    if not pack:
        return sorted(batch, key=lambda i: -own[i])
    rows = prompt_groups(samples, list(batch))
    rows.sort(key=lambda row: -_packed_length(samples, row))
    return [i for row in rows for i in sorted(row, key=lambda i: -own[i])]


def _padded_tokens(samples: list[Sample], part: list[int], pack: bool = False) -> int:
    extra = sum(len(_segments(samples[i])) for i in part)  # routing replay's rows for earlier computations
    if pack:
        rows = prompt_groups(samples, part)
        return (len(rows) + extra) * max(_packed_length(samples, row) for row in rows)
    return (len(part) + extra) * max(len(samples[i].prompt_ids) + samples[i].response_length for i in part)


def token_budget_split(
    samples: list[Sample], shares: list[list[int]], max_tokens: int, pack: bool = False
) -> list[list[list[int]]]:
    """Every rank's share (longest first) cut into micro-batches of consecutive samples whose
    padded size (rows x longest row; a row is a sample, or packed a prompt and its responses)
    stays within ``max_tokens``; a sample longer than the budget
    goes alone. Then every rank gets as many micro-batches as the rank with most (the largest
    ones split in two): FSDP's collectives need the same number of forwards on every rank.
    Every rank computes every rank's plan, so they agree without talking."""
    plans = []
    for share in shares:
        parts: list[list[int]] = []
        for i in share:
            if parts and _padded_tokens(samples, parts[-1] + [i], pack) <= max_tokens:
                parts[-1].append(i)
            else:
                parts.append([i])
        plans.append(parts)
    target = max(len(p) for p in plans)
    for r, parts in enumerate(plans):
        if len(shares[r]) < target:
            raise SampleError(
                f"token budget {max_tokens}: rank {r} holds {len(shares[r])} samples, fewer than the {target} "
                "micro-batches another rank needs"
            )
        while len(parts) < target:
            k = max(
                (j for j in range(len(parts)) if len(parts[j]) > 1),
                key=lambda j: _padded_tokens(samples, parts[j], pack),
            )
            half = len(parts[k]) // 2
            parts[k : k + 1] = [parts[k][:half], parts[k][half:]]
    return plans
