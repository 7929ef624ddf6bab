"""SGLang's response shapes for our engine's completions (SGLang 0.5.23, docs/engines.md)."""

from __future__ import annotations

from dataclasses import dataclass

from ..core import wire
from ..core.routing import encode_int32, encode_npy
from ..errors import RequestError
from ..protocol import Completion, GenerateRequest


@dataclass(frozen=True)
class ResponseForm:
    """How a client asked for the captured data: the support's form, the routing's form and start."""

    sampling_mask_format: str = "lists"
    routed_experts_format: str = "sglang"
    routed_experts_start_len: int = 0


def meta_info(
    completion: Completion, request: GenerateRequest, *, form: ResponseForm, vocab_size: int, num_experts: int = 0
) -> dict:
    """SGLang's ``meta_info`` of one completion, in SGLang 0.5.23's shapes (docs/engines.md).

    The support goes as id lists (SGLang's form) unless the client asked for our binary
    form; ``output_token_sampling_mask_length`` is the number of rows, as SGLang sends it.
    ``routed_experts`` is SGLang's raw int32 base64 of positions ``[start, prompt + output - 1)``,
    or vLLM's compact ``.npy`` form where the client asked for ``npy``; ``routed_experts_history`` (ours) the
    routing of each earlier computation of a prefix that a retract's recompute routed again, in the same form.
    """
    sampling_mask_format = form.sampling_mask_format
    meta = {
        "finish_reason": completion.finish_reason,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": completion.num_tokens,
        "weight_version": completion.weight_version,
        "weight_versions": [span.to_json() for span in completion.weight_versions],
    }
    if request.return_logprob:
        meta["output_token_logprobs"] = [
            [lp, tok, None] for lp, tok in zip(completion.full_logprobs.tolist(), completion.output_ids)
        ]
    if request.return_sampling_mask:
        support = completion.support
        if sampling_mask_format == "binary":
            meta["output_token_sampling_mask"] = wire.to_json(support, vocab_size, completion.output_ids)
        else:
            meta["output_token_sampling_mask"] = support.to_lists()
        if request.sampling_logprobs_mode == "support" and sampling_mask_format == "binary":
            # ours: every id's log q, float32 little-endian, rows in the binary mask's (ascending) order
            meta["output_token_sampling_logprobs"] = wire.floats_to_json(completion.support_row_logprobs)
        elif request.sampling_logprobs_mode == "support":
            meta["output_token_sampling_logprobs"] = [row.tolist() for row in completion.support_row_logprobs]
        else:
            meta["output_token_sampling_logprobs"] = completion.log_mu.tolist()
        meta["output_token_sampling_mask_length"] = support.num_rows
        if completion.sampler is not None:  # ours: what the engine sampled with (SGLang sends no such record)
            meta["sampler"] = completion.sampler
    if request.return_routed_experts:
        routed = completion.routed_experts[form.routed_experts_start_len :]
        npy = form.routed_experts_format == "npy"
        meta["routed_experts"] = encode_npy(routed, num_experts) if npy else encode_int32(routed)
        if completion.routed_experts_history:  # ours: the routing each retract's recompute replaced, same form
            meta["routed_experts_history"] = [
                encode_npy(r, num_experts) if npy else encode_int32(r)
                for r in (earlier[form.routed_experts_start_len :] for earlier in completion.routed_experts_history)
            ]
    return meta


def json_bytes_per_id(request: GenerateRequest, vocab_size: int) -> int:
    """About the bytes of one captured id as JSON: its digits and ", ", and in support mode its log-prob's (a
    float's repr runs to some 20 characters)."""
    per_id = len(str(max(vocab_size - 1, 0))) + 2
    return per_id + (22 if request.sampling_logprobs_mode == "support" else 0)


def check_json_bound(requests, form: ResponseForm, vocab_size: int, limit: int) -> None:
    """400 before a body runs when its requests bounded by a ``top_k`` may capture more than ``limit`` bytes as
    JSON lists (``max_new_tokens`` x ``top_k`` ids each); one bounded by top-p alone is checked as its answer is
    built (``check_json_capture``): its bound, the whole capacity per token, says little of what it captures."""
    if form.sampling_mask_format == "binary":
        return
    bounded = [r for r in requests if r.return_sampling_mask and r.params.top_k > 0]
    total = sum(r.max_new_tokens * r.params.top_k * json_bytes_per_id(r, vocab_size) for r in bounded)
    if total > limit:
        ids = sum(r.max_new_tokens * r.params.top_k for r in bounded)
        raise RequestError(
            f"sampling_mask_format: this body may capture {ids:,} support ids (max_new_tokens x top_k), about "
            f"{total / 2**20:.1f} MiB as JSON lists, over this engine's max_json_capture_bytes of {limit:,} bytes; "
            'ask for "sampling_mask_format": "binary" (ids packed, log-probs float32) or for fewer samples, tokens '
            "or a smaller top_k"
        )


def json_capture_bytes(completion: Completion, request: GenerateRequest, vocab_size: int) -> int:
    """About the bytes of ``completion``'s captured support as JSON id lists (``json_bytes_per_id``)."""
    if not request.return_sampling_mask or completion.support is None:
        return 0
    return int(completion.support.ids.size) * json_bytes_per_id(request, vocab_size)


def check_json_capture(answers, form: ResponseForm, vocab_size: int, limit: int) -> None:
    """400 for an answer (``(request, completion)`` pairs) whose captured support would pass ``limit`` bytes as
    JSON lists; the binary form is never chosen silently for a client that asked for lists."""
    if form.sampling_mask_format == "binary":
        return
    pairs = list(answers)
    total = sum(json_capture_bytes(c, r, vocab_size) for r, c in pairs)
    if total > limit:
        ids = sum(int(c.support.ids.size) for r, c in pairs if r.return_sampling_mask and c.support is not None)
        raise RequestError(
            f"sampling_mask_format: the captured support of this answer ({ids:,} ids) is about {total / 2**20:.1f} "
            f"MiB as JSON lists, over this engine's max_json_capture_bytes of {limit:,} bytes; ask for "
            '"sampling_mask_format": "binary" (ids packed, log-probs float32) or for fewer samples or tokens'
        )
