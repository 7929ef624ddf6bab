"""The request half of the engine's checks: what it refuses before a request takes a slot (HTTP 400), and the
support a body may capture. A mixin of ``Engine`` (engine.py), reading its limits, capacity and parts."""

from __future__ import annotations

from ..errors import RequestError, SamplingParamsError
from ..protocol import GenerateRequest
from .kv_budget import column_need


class RequestChecks:
    def validate(self, request: GenerateRequest) -> None:
        """Reject what this engine cannot serve before it takes a slot (HTTP 400)."""
        bad = [t for t in request.input_ids if t >= self.vocab_size]
        if bad:
            raise RequestError(f"input_ids: token {bad[0]} outside the vocabulary [0, {self.vocab_size})")
        k = request.params.top_k
        if request.return_sampling_mask and k > self.capacity:
            raise RequestError(
                f"top_k={k} exceeds sampling_mask_max_tokens={self.capacity}: the support could not be captured"
            )
        if request.grammar is not None:
            self._check_grammar(request)
        self.adapters.check_request(request.lora_path)
        if request.return_routed_experts and self.runner.routing is None:
            raise RequestError("return_routed_experts: this model has no experts to route (a dense model)")
        try:
            request.penalties.check(self.semantics, self.vocab_size)
        except SamplingParamsError as exc:
            raise RequestError(f"sampling_params: {exc} (engine semantics {self.semantics})") from exc
        self.limits.validate(request, self.context_length)
        self.kv_budget.check_alone(len(request.input_ids), self._column_need(request))

    def _check_grammar(self, request: GenerateRequest) -> None:
        """A constrained request's support must stay capturable, and the grammar must end the output."""
        k = request.params.top_k
        if request.return_sampling_mask and not 1 <= k <= self.capacity:
            raise RequestError(
                f"top_k={k}: a grammar-constrained request that captures its support needs a top_k in "
                f"[1, sampling_mask_max_tokens={self.capacity}] (inside a JSON string a grammar allows most of the "
                "vocabulary)"
            )
        if request.return_logprob or request.top_logprobs:
            raise RequestError(
                "logprobs: a grammar-constrained request's policy is the grammar-masked distribution; ask for its "
                "log-probs with a top_k filter (they then come with the captured support)"
            )
        for name in ("ignore_eos", "min_new_tokens"):
            if getattr(request, name):
                raise RequestError(f"{name}={getattr(request, name)!r}: a grammar ends the output at EOS itself")
        self.grammars.check(request.grammar)

    def _column_need(self, request: GenerateRequest) -> int:
        # whole blocks: a row attended in place is viewed at its width rounded up to them, inside its own reservation
        return column_need(len(request.input_ids), request.max_new_tokens, self.runner.pool.block_size)

    def capture_bound(self, request: GenerateRequest) -> int:
        """The most support ids ``request`` may capture: per token its top_k, or the capacity where no top_k
        bounds the row (top_p, min_p)."""
        if not request.return_sampling_mask:
            return 0
        k = request.params.top_k
        return request.max_new_tokens * (min(k, self.capacity) if k > 0 else self.capacity)

    def check_capture_budget(self, requests: list[GenerateRequest]) -> None:
        """400 for a body whose requests together may capture more than ``limits.max_capture_ids`` ids (a
        192-byte body asked for 66.7 MiB of support; at SmolLM2's defaults with n=64, about 170 GB)."""
        bounds = [self.capture_bound(r) for r in requests]
        total, limit = sum(bounds), self.limits.max_capture_ids
        if total > limit:
            worst = max(range(len(requests)), key=bounds.__getitem__)
            r = requests[worst]
            per = bounds[worst] // max(r.max_new_tokens, 1)
            raise RequestError(
                f"return_sampling_mask: {len(requests)} request(s) may capture {total:,} support ids (the largest: "
                f"max_new_tokens {r.max_new_tokens} x {per} ids per token, its top_k or sampling_mask_max_tokens), "
                f"over this engine's max_capture_ids of {limit:,}; ask for fewer samples, tokens or a smaller top_k"
            )
