"""Which request fields a route takes beyond the ones it implements: none is silently ignored.

A route's schema declares what it implements. Any other field of a body is either on the no-op list
(it does not change what is sampled: OpenAI's ``user``, ``store``, ``service_tier``, ...; clients such
as verifiers send them), or taken only at its default (``echo: false`` asks for nothing; ``echo: true``
is refused with the reason), or refused by name as no field of the route. docs/agents.md lists them.
"""

from __future__ import annotations

from typing import Any

# fields accepted with any value: they shape bookkeeping, caching, latency or billing, not the tokens sampled
NO_OP_FIELDS = {
    "user": "an end-user id for the provider's monitoring",
    "metadata": "labels stored with the request",
    "store": "whether the provider stores the request",
    "service_tier": "the provider's latency tier",
    "safety_identifier": "an end-user id for the provider's monitoring",
    "prompt_cache_key": "a caching hint",
    "prompt_cache_retention": "a caching hint",
    "prompt_cache_options": "a caching hint",
    "cache_salt": "salts a prefix cache",
    "extra_key": "salts a prefix cache (SGLang)",
    "parallel_tool_calls": "every call in the output is parsed",
    "reasoning_effort": "the model has no reasoning mode",
    "verbosity": "the model has no reasoning mode",
    "include_reasoning": "the model has no reasoning mode",
    "separate_reasoning": "the model has no reasoning mode (SGLang's; sglang-router sends it)",
    "stream_reasoning": "the model has no reasoning mode (SGLang's; sglang-router sends it)",
    "model": "the served model's name on SGLang's /generate (sglang-router sends it): one model here",
    "prediction": "a speculative-decoding hint: it changes latency, not the tokens",
    "request_id": "a tracing id (vLLM's)",
    "session_id": "a tracing id (vLLM's chat field)",
    "priority": "the scheduling order, not what is sampled",
    "stream_interval": "how often a stream flushes",
    "log_metrics": "the server's own metrics (SGLang)",
    "no_logs": "the server's own logs (SGLang)",
    "custom_labels": "the server's own metrics (SGLang)",
    "external_trace_header": "a tracing header (SGLang)",
    "received_time": "a timestamp (SGLang)",
    "routing_key": "a router's affinity key (ours travels as X-Session-ID)",
    "conversation_id": "a router's affinity key (SGLang)",
    "data_parallel_rank": "which data-parallel rank serves it (one here)",
    "routed_dp_rank": "which data-parallel rank serves it (one here)",
    "return_text_in_logprobs": "SGLang's logprob entries carry no text here",
}

# fields taken only at their default (null is the default too); any other value is refused, with the reason
DEFAULT_ONLY = {
    "echo": (False, "echoing the prompt is not implemented"),
    "suffix": (None, "insertion (suffix) is not implemented"),
    "use_beam_search": (False, "beam search is not implemented: replay needs the sampler's support"),
    "length_penalty": (1.0, "a beam-search setting; beam search is not implemented"),
    "best_of": (None, "best_of is not implemented (send n)"),
    "audio": (None, "audio output is not implemented"),
    "modalities": (["text"], "only text output is implemented"),
    "web_search_options": (None, "web search is not implemented"),
    "functions": (None, "the deprecated functions field is not implemented; send tools"),
    "function_call": (None, "the deprecated function_call field is not implemented; send tool_choice"),
    "moderation": (None, "moderation is not implemented"),
    "thinking_token_budget": (None, "the model has no reasoning mode to budget"),
    "truncate_prompt_tokens": (None, "prompt truncation is not implemented; send a prompt that fits"),
    "truncation_side": (None, "prompt truncation is not implemented"),
    "prompt_logprobs": (None, "prompt log-probs would be a recomputation over the prefill, not what sampled"),
    "logprob_token_ids": (None, "log-probs of chosen ids are not implemented"),
    "allowed_token_ids": (None, "an allowed-ids mask is not implemented"),
    "bad_words": (None, "bad words are not implemented"),
    "guided_json": (None, "guided decoding is not implemented"),
    "guided_regex": (None, "guided decoding is not implemented"),
    "guided_choice": (None, "guided decoding is not implemented"),
    "guided_grammar": (None, "guided decoding is not implemented"),
    "continue_final_message": (False, "continuing the final message is not implemented"),
    "add_special_tokens": (False, "the chat template's special tokens are the prompt's"),
    "documents": (None, "documents for the chat template are not implemented"),
    "chat_template": (None, "the chat template is the server's (--chat-template)"),
    "chat_template_kwargs": (None, "chat template arguments are not implemented"),
    "media_io_kwargs": (None, "media input is not implemented"),
    "mm_processor_kwargs": (None, "media input is not implemented"),
    "mm_payload": (None, "media input is not implemented"),
    "return_mm_kwargs": (False, "media input is not implemented"),
    "kv_transfer_params": (None, "disaggregated serving is not implemented"),
    "ec_transfer_params": (None, "disaggregated serving is not implemented"),
    "vllm_xargs": (None, "vLLM's extra arguments are not implemented"),
    "repetition_detection": (None, "repetition detection is not implemented"),
    "watermarking": (None, "watermarking is not implemented"),
    "watermark": (None, "watermarking is not implemented"),
    "routed_experts_prompt_start": (0, "routed experts come from /generate (meta_info.routed_experts)"),
    "return_token_offsets": (False, "token offsets are not implemented"),
    "return_prompt_text": (False, "the prompt's text is not returned"),
    "return_tokens_as_token_ids": (False, "log-prob tokens are sent as text"),
    "return_token_ids": (False, "token ids come with return_meta_info (meta_info.output_ids)"),
    "add_generation_prompt": (True, "the generation prompt is always added"),
    "features": (None, "media input is not implemented"),
    "content_parts": (None, "media input is not implemented"),
    "token_offsets": (None, "token offsets are not implemented"),
    "reasoning_ended": (None, "the model has no reasoning mode"),
    "reasoning_parser_kwargs": (None, "the model has no reasoning mode"),
    "prompt_embeds": (None, "embeddings as input are not implemented"),
    "input_embeds": (None, "embeddings as input are not implemented"),
    "image_data": (None, "media input is not implemented"),
    "video_data": (None, "media input is not implemented"),
    "audio_data": (None, "media input is not implemented"),
    "mm_hashes": (None, "media input is not implemented"),
    "mm_content_hashes": (None, "media input is not implemented"),
    "top_logprobs_num": (0, "SGLang's top log-probs are not implemented (the support comes with the mask)"),
    "token_ids_logprob": (None, "log-probs of chosen ids are not implemented"),
    "return_flat_raw_top_logprobs": (False, "SGLang's raw top log-probs are not implemented"),
    "return_flat_raw_output_top_logprobs": (False, "SGLang's raw top log-probs are not implemented"),
    "return_hidden_states": (False, "hidden states are not returned"),
    "return_indexer_topk": (False, "not a model with a top-k indexer"),
    "return_entropy": (False, "entropies are not returned"),
    "return_bytes": (False, "token bytes are not returned"),
    "return_prompt_token_ids": (False, "the prompt's ids are the request's"),
    "session_params": (None, "SGLang's stateful sessions are not implemented (ours: /sessions and X-Session-ID)"),
    "lora_path": (None, "a loaded LoRA adapter is named on /generate (lora_path), where the engine serves it"),
    "lora_id": (None, "SGLang's internal adapter id: name the adapter with lora_path on /generate"),
    "custom_logit_processor": (None, "custom logit processors are not implemented: the trainer could not replay them"),
    "bootstrap_host": (None, "disaggregated serving is not implemented"),
    "bootstrap_port": (None, "disaggregated serving is not implemented"),
    "bootstrap_room": (None, "disaggregated serving is not implemented"),
    "bootstrap_pair_key": (None, "disaggregated serving is not implemented"),
    "decode_tp_size": (None, "disaggregated serving is not implemented"),
    "disagg_prefill_dp_rank": (None, "disaggregated serving is not implemented"),
    "background": (False, "background requests are not implemented"),
    "require_reasoning": (False, "the model has no reasoning mode"),
    "max_thinking_tokens": (None, "the model has no reasoning mode"),
    "positional_embed_overrides": (None, "not implemented"),
    "use_audio_in_video": (False, "media input is not implemented"),
    "video_config": (None, "media input is not implemented"),
    # SGLang's sampling_params
    "structural_tag": (None, "constrained decoding is not implemented"),
    "stop_regex": (None, "stop regular expressions are not implemented; send stop strings"),
    "beam_width": (None, "beam search is not implemented"),
    "custom_params": (None, "custom logit processors are not implemented"),
    "images_config": (None, "media input is not implemented"),
}


def _at_default(value: Any, default: Any) -> bool:
    return value is None or value == default or (isinstance(value, (list, dict)) and not value and not default)


def field_problem(name: str, value: Any, route: str) -> str | None:
    """Why ``route`` cannot take the undeclared field ``name=value``, or None when it may (no-op or default)."""
    if name in NO_OP_FIELDS:
        return None
    if name in DEFAULT_ONLY:
        default, why = DEFAULT_ONLY[name]
        return None if _at_default(value, default) else f"{name}={value!r:.80}: {why}"
    return f"{name}: not a field of {route} (docs/agents.md lists the fields each route takes)"


def check_undeclared(extra: dict | None, route: str) -> None:
    """Refuse (``ValueError``: a 400 naming the field) the first undeclared field ``route`` cannot take."""
    for name, value in (extra or {}).items():
        problem = field_problem(name, value, route)
        if problem is not None:
            raise ValueError(problem)


def field_class(name: str, declared: set[str]) -> str:
    """How a route with the ``declared`` fields treats ``name``: implemented, no-op, default-only or unknown."""
    if name in declared:
        return "implemented"
    if name in NO_OP_FIELDS:
        return "no-op"
    return "default-only" if name in DEFAULT_ONLY else "unknown"
