"""What one engine accepts: bounds on every request and on its queue, checked before a request
takes a slot, reported by ``/model_info``. A request outside them gets a 400 naming the field; a
full queue answers 503."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ..errors import RequestError
from ..protocol import GenerateRequest


def _limit(default: int, help: str, *, flags: tuple = ()):
    """A bound with what its ``serve`` flag says (``flags``: SGLang's names for it)."""
    return field(default=default, metadata={"help": help, "flags": flags})


@dataclass(frozen=True)
class EngineLimits:
    max_new_tokens: int = _limit(4096, "largest max_new_tokens a request may ask")
    max_prompt_tokens: int = _limit(32768, "longest prompt (lowered to the model's context length by the engine)")
    max_stop_strings: int = _limit(16, "stop strings a request may name")
    max_stop_string_length: int = _limit(256, "characters of one stop string")
    max_stop_token_ids: int = _limit(64, "stop token ids a request may name")
    max_batch_size: int = _limit(
        64, "sequences decoded together (SGLang's --max-running-requests)", flags=("--max-running-requests",)
    )
    max_queue: int = _limit(256, "requests waiting for a slot (503 with Retry-After beyond)")
    # a top-p request of 4,096 tokens at capacity 4,096 is 2^24
    max_capture_ids: int = _limit(
        2**26,
        "support ids one body (all its n samples) may capture at most: max_new_tokens x top_k (or x "
        "--sampling-mask-max-tokens where no top_k bounds a row), summed; 400 beyond",
    )
    max_capture_ids_running: int = _limit(
        2**27, "support ids the running requests may hold captured at once; past it new requests wait"
    )
    max_json_capture_bytes: int = _limit(
        32 * 2**20, "an answer's captured support as JSON id lists; 400 beyond, naming sampling_mask_format=binary"
    )
    # structured outputs (engine/grammar.py): each constrained request decodes with its own mask
    max_grammar_requests: int = _limit(64, "grammar-constrained requests one body may carry; 400 beyond")
    max_grammars_cached: int = _limit(
        64, "distinct compiled grammars kept (an LRU); a request copies its grammar's matcher"
    )
    grammar_compile_ms: int = _limit(
        5000, "a grammar's compile in the grammar worker process; past it the process is killed, 400"
    )
    max_grammar_compiles_waiting: int = _limit(16, "grammars waiting for the grammar worker process; 503 beyond")

    def __post_init__(self):
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be an integer >= 1, got {value!r}")

    def to_json(self) -> dict:
        return asdict(self)

    def check_body(self, requests: list[GenerateRequest]) -> None:
        """What bounds a body as a whole: its grammar-constrained requests."""
        constrained = sum(r.grammar is not None for r in requests)
        if constrained > self.max_grammar_requests:
            raise RequestError(
                f"grammar: {constrained} grammar-constrained requests in one body exceed the limit of "
                f"{self.max_grammar_requests}"
            )

    def validate(self, request: GenerateRequest, context_length: int | None) -> None:
        """Raise ``RequestError`` naming the field when ``request`` is outside the limits."""
        n = len(request.input_ids)
        if n > self.max_prompt_tokens:
            raise RequestError(f"input_ids: {n} prompt tokens exceed the limit of {self.max_prompt_tokens}")
        if request.max_new_tokens > self.max_new_tokens:
            raise RequestError(f"max_new_tokens: {request.max_new_tokens} exceeds the limit of {self.max_new_tokens}")
        if context_length is not None and n + request.max_new_tokens > context_length:
            raise RequestError(
                f"max_new_tokens: {n} prompt tokens + {request.max_new_tokens} new tokens exceed the context length "
                f"{context_length}"
            )
        if len(request.stop) > self.max_stop_strings:
            raise RequestError(f"stop: {len(request.stop)} stop strings exceed the limit of {self.max_stop_strings}")
        long = next((s for s in request.stop if len(s) > self.max_stop_string_length), None)
        if long is not None:
            raise RequestError(
                f"stop: a stop string of {len(long)} characters exceeds the limit of {self.max_stop_string_length}"
            )
        if len(request.stop_token_ids) > self.max_stop_token_ids:
            raise RequestError(
                f"stop_token_ids: {len(request.stop_token_ids)} ids exceed the limit of {self.max_stop_token_ids}"
            )
