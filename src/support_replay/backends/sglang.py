"""SGLang >= 0.5.20 over HTTP; also our own server and router, which speak the same ``/generate``.

The response's ``meta_info`` is read as SGLang 0.5.23 writes it (docs/engines.md, read from
the wheel: ``sglang/srt/managers/tokenizer_manager.py``): ``output_token_sampling_mask``
(one id list per output token, ordered by descending weight), ``output_token_sampling_logprobs``
(one float per token, or one list per token aligned with the mask in ``"support"`` mode),
``output_token_sampling_mask_length`` (one integer: the number of mask rows), and the
weights that sampled the tokens (``weight_versions`` spans, or only ``weight_version``).
Our own server may send the mask in our base64 binary form instead, when asked.
``routed_experts`` (``return_routed_experts``) is SGLang's base64 of raw int32
``[prompt + output - 1, layers, top_k]``, read with the model's layers and top-k; our server sends
vLLM's compact ``.npy`` form when asked (``routed_experts_format: "npy"``), told apart by its magic.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from ..core.routing import RoutingShape, decode_int32, decode_npy
from ..core.support import SupportTable
from ..core.wire import floats_from_json, from_json
from ..errors import EngineUnavailable, SupportError, WireError
from ..protocol import Completion, GenerateRequest, parse_version_spans, single_version, validate_completion
from ..serving.security import Keys
from .base import RetryCounter, fan_out, optional_fields, post_json, sampling_settings, session_headers
from .cancellation import Cancellation, close_socket_of

MASK_FORMATS = ("binary", "lists")
STRIPPED_HINT = (
    "the request must set return_sampling_mask (and return_meta_info on chat completions); "
    "if it did, a router on the path (sglang-router drops fields its schema does not declare) may have stripped it"
)


def sampling_params_json(req: GenerateRequest) -> dict:
    """Every sampling setting, sent explicitly: a server fills the ones left out from the
    model's generation_config.json (SGLang's default ``--sampling-defaults model``), which may
    hold a repetition penalty the trainer would not know of. A request naming its
    ``sent_sampling_fields`` (the audit, acting as a user's client) leaves the others out."""
    out = {
        **sampling_settings(req),
        "max_new_tokens": req.max_new_tokens,
        "ignore_eos": req.ignore_eos,
        **optional_fields(req, "sampling_seed"),
    }
    if req.grammar is not None:  # ours (llguidance's serialized form): SGLang refuses the field, failing closed
        out["grammar"] = req.grammar
    return out


# ---- meta_info -> (support, log mu) ------------------------------------------------------


def _id_rows(rows, field: str) -> list[list[int]]:
    if not isinstance(rows, list):
        raise WireError(f"{field}: expected a list with one id list per token, got {type(rows).__name__}")
    for t, row in enumerate(rows):
        if not isinstance(row, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in row):
            raise WireError(f"{field}[{t}]: expected a list of integer token ids, got {row!r:.80}")
        if not row:
            raise WireError(f"{field}[{t}]: empty support")
    return rows


def _float_list(values, field: str, count: int) -> np.ndarray:
    if not isinstance(values, list) or len(values) != count:
        n = len(values) if isinstance(values, list) else type(values).__name__
        raise WireError(f"{field}: {n} entries for {count} tokens")
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise WireError(f"{field}: expected one number per token: {exc}") from exc


def _selected_in_support_mode(logprobs: list, rows: list[list[int]], output_ids: list[int]) -> list:
    """``"support"`` mode sends log mu of every id of each row; keep the sampled token's."""
    picked = []
    for t, (row_lp, row_ids, tok) in enumerate(zip(logprobs, rows, output_ids)):
        if not isinstance(row_lp, list) or len(row_lp) != len(row_ids):
            raise WireError(
                f"output_token_sampling_logprobs[{t}]: expected {len(row_ids)} values aligned with the mask"
            )
        if tok not in row_ids:
            raise WireError(f"output_token_sampling_mask[{t}]: selected token {tok} is not in its support")
        picked.append(row_lp[row_ids.index(tok)])
    return picked


def _canonical_rows(logprobs: list, rows: list[list[int]]) -> list[np.ndarray]:
    """``"support"`` mode's per-id values (SGLang's order: by descending weight) in each row's ascending id order."""
    out = []
    for t, (row_lp, row_ids) in enumerate(zip(logprobs, rows)):
        values = _float_list(row_lp, f"output_token_sampling_logprobs[{t}]", len(row_ids))
        out.append(values[np.argsort(np.asarray(row_ids), kind="stable")].astype(np.float32))
    return out


def _aborted(meta: dict) -> bool:
    reason = meta.get("finish_reason")
    return isinstance(reason, dict) and reason.get("type") == "abort"


def parse_meta_info(
    meta: dict, output_ids: list[int], vocab_size: int
) -> tuple[SupportTable, np.ndarray, int, list[np.ndarray] | None]:
    """``(support, log mu float32[T], support bytes, log q of every support id or None)`` from an
    SGLang ``meta_info`` (the last in ``"support"`` mode, each row in ascending id order).

    Parses only: the one full validation happens in ``validate_completion``.
    """
    mask = meta.get("output_token_sampling_mask")
    if mask is None and not output_ids and _aborted(meta):
        # a request aborted in SGLang's waiting queue, never prefilled, answers with no output and no mask
        # (0.5.23: tokenizer_manager._handle_abort_req, "Abort in waiting queue"): nothing was sampled
        return SupportTable.from_lists([]), np.zeros(0, np.float32), 0, None
    if mask is None:
        raise WireError(f"meta_info has no output_token_sampling_mask: {STRIPPED_HINT}")
    logprobs = meta.get("output_token_sampling_logprobs")
    if logprobs is None:
        raise WireError("meta_info has output_token_sampling_mask but no output_token_sampling_logprobs")
    n = len(output_ids)
    rows = None
    if isinstance(mask, str):  # our binary form, relative to the sampled tokens
        support = from_json(mask, np.asarray(output_ids, np.int64), vocab_size)
        size = len(mask)
    else:
        rows = _id_rows(mask, "output_token_sampling_mask")
        try:
            support = SupportTable.from_lists(rows)
        except SupportError as exc:
            raise WireError(f"output_token_sampling_mask: {exc}") from exc
        size = len(json.dumps(mask, separators=(",", ":")))
    if support.num_rows != n:
        raise WireError(f"output_token_sampling_mask: {support.num_rows} support rows for {n} output tokens")
    length = meta.get("output_token_sampling_mask_length")
    if length is not None and (isinstance(length, bool) or length != support.num_rows):
        raise WireError(
            f"output_token_sampling_mask_length={length!r:.80}: SGLang sends the number of mask "
            f"rows, {support.num_rows}"
        )
    row_logprobs = None
    if isinstance(logprobs, str):  # ours: every id's log q with the binary mask, ascending id order
        if rows is not None:
            raise WireError("output_token_sampling_logprobs in binary form needs the mask in binary form")
        row_logprobs = floats_from_json(logprobs, support.sizes(), "output_token_sampling_logprobs")
        size += len(logprobs)
        position, found = support.locate(np.asarray(output_ids))
        if not found.all():
            t = int(np.flatnonzero(~found)[0])
            raise WireError(f"output_token_sampling_mask[{t}]: selected token {output_ids[t]} is not in its support")
        logprobs = np.concatenate(row_logprobs)[position].tolist() if row_logprobs else []
    elif isinstance(logprobs, list) and any(isinstance(v, list) for v in logprobs):
        if rows is None:
            raise WireError("output_token_sampling_logprobs in 'support' mode needs the mask as id lists")
        picked = _selected_in_support_mode(logprobs, rows, output_ids)  # checks the rows' alignment first
        row_logprobs = _canonical_rows(logprobs, rows)
        logprobs = picked
    log_mu = _float_list(logprobs, "output_token_sampling_logprobs", n)
    return support, log_mu.astype(np.float32), size, row_logprobs


NPY_BASE64 = "k05VTVBZ"  # base64 of the magic that opens a .npy file


def parse_routed_experts(value, shape: RoutingShape | None, where: str) -> tuple[np.ndarray, int]:
    """``(routing [positions, layers, top_k], characters on the wire)`` from ``meta_info["routed_experts"]``."""
    if isinstance(value, str) and value.startswith(NPY_BASE64):
        return decode_npy(value, where), len(value)
    if shape is None:
        raise WireError(
            f"{where}: routed_experts in SGLang's raw int32 form needs the model's layer count and top-k "
            "(the backend was built without a routing shape)"
        )
    return decode_int32(value, shape.layers, shape.top_k, where), len(value)


def parse_routing_history(value, shape: RoutingShape | None, where: str) -> tuple[list[np.ndarray], int]:
    """Our ``meta_info["routed_experts_history"]`` (absent from SGLang's answers: an empty history), each entry
    in ``routed_experts``' form; and its characters on the wire."""
    if value is None:
        return [], 0
    if not isinstance(value, list):
        raise WireError(
            f"{where}: routed_experts_history must be a list of routing strings, got {type(value).__name__}"
        )
    history = [parse_routed_experts(v, shape, f"{where} routed_experts_history[{k}]") for k, v in enumerate(value)]
    return [routing for routing, _ in history], sum(n for _, n in history)


def parse_weight_versions(meta: dict, num_tokens: int, where: str, per_token: bool = False):
    """The spans of the weights that sampled each output token. ``per_token`` (a push may land among running requests:
    ``--weight-sync-mode retract`` or ``in_place``): an answer with one ``weight_version`` only would read every
    token as that version's, so it is refused."""
    if num_tokens == 0:  # an answer stopped before its first token: SGLang 0.5.23 names a span [0, 0), or none
        return []
    if "weight_versions" in meta:
        return parse_version_spans(meta["weight_versions"], num_tokens, where)
    if per_token:
        raise WireError(
            f"{where}: meta_info has no weight_versions (the weights of each output token), which a push among running "
            f"requests (--weight-sync-mode retract or in_place) needs: weight_version "
            f"{meta.get('weight_version')!r} alone would name every token's; use an engine that reports them "
            "(SGLang 0.5.23, support-replay serve) or --weight-sync-mode wait"
        )
    if meta.get("weight_version") is not None:
        return single_version(str(meta["weight_version"]), num_tokens)
    return []


# ---- the backend ----------------------------------------------------------------------


class SGLangBackend:
    """One ``POST /generate`` per request, sent concurrently (the engine batches them).

    One request per call keeps typed routers (sglang-router declares a single
    ``sampling_params`` object) on the path working. ``sampling_mask_format="binary"``
    asks our server for the compact wire form of the support; SGLang ignores the field and
    answers with lists, which are read just the same.
    """

    def __init__(
        self,
        url: str,
        vocab_size: int,
        *,
        api_key: str | None = None,
        timeout: float | None = 600.0,
        sampling_mask_format: str = "binary",
        concurrency: int = 64,
        transport: httpx.BaseTransport | None = None,
        routing_shape: RoutingShape | None = None,
        lora_path: str | None = None,
        per_token_versions: bool = False,
    ):
        # a push may land among running requests: answers must carry per-token spans (parse_weight_versions)
        self.per_token_versions = per_token_versions
        self.routing_shape = routing_shape  # the trainer's model's: reads SGLang's raw routing, checks any
        self.lora_path = lora_path  # the loaded LoRA adapter every request runs with (SGLang's field), or None
        if sampling_mask_format not in MASK_FORMATS:
            raise ValueError(f"sampling_mask_format: one of {MASK_FORMATS}, got {sampling_mask_format!r}")
        self.url = url.rstrip("/")
        self.vocab_size = vocab_size
        self.sampling_mask_format = sampling_mask_format
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=httpx.Timeout(timeout, connect=10.0), headers=headers, transport=transport)
        self.pool = ThreadPoolExecutor(concurrency)
        self._retries = RetryCounter()

    @property
    def retries(self) -> int:
        return self._retries.value

    def body(self, req: GenerateRequest) -> dict:
        body = {
            "input_ids": list(req.input_ids),
            "sampling_params": sampling_params_json(req),
            "return_logprob": req.return_logprob,
        }
        if req.rid is not None:
            body["rid"] = req.rid
        lora = req.lora_path if req.lora_path is not None else self.lora_path
        if lora is not None:
            body["lora_path"] = lora
        if req.return_sampling_mask:
            body["return_sampling_mask"] = True
            if req.sampling_logprobs_mode != "selected":
                body["sampling_logprobs_mode"] = req.sampling_logprobs_mode
            if self.sampling_mask_format == "binary":
                body["sampling_mask_format"] = "binary"
        if req.return_routed_experts:
            body["return_routed_experts"] = True
            body["routed_experts_format"] = "npy"  # ours; SGLang ignores it and sends raw int32
        return body

    def generate(
        self, requests: list[GenerateRequest], *, return_exceptions: bool = False, on_done=None, partial: bool = False
    ) -> list:
        """One ``Completion`` per request; with ``return_exceptions`` an ``EngineUnavailable`` in
        the place of a request no engine answered (or that came back aborted, unless ``partial``: then an aborted
        answer is returned with the tokens it has). ``on_done(i, finished)`` hears of each as it ends."""

        def one(req: GenerateRequest, index: int) -> Completion:
            try:
                completion = self._one(req, index, partial)
            except Exception:
                if on_done is not None:
                    on_done(index, False)
                raise
            if on_done is not None:
                on_done(index, completion.finish_reason.get("type") != "abort")
            return completion

        return fan_out(self.pool, one, requests, return_exceptions)

    def stop(self, requests: list[GenerateRequest]) -> None:
        """SGLang's ``/abort_request {"rid"}`` for each (our router sends it to every engine): each request ends
        now and its ``/generate`` answers with the tokens so far, finish reason ``abort``. Every one is asked even
        when one fails; then an ``EngineUnavailable`` names the engine and the requests not stopped."""
        headers = Keys.load().header(admin=True)
        failed = []
        for req in requests:
            if req.rid is None:
                continue
            try:
                reply = self.client.post(self.url + "/abort_request", json={"rid": req.rid}, headers=headers)
            except httpx.HTTPError as exc:
                failed.append(f"{req.rid} ({type(exc).__name__}: {exc})")
                continue
            if reply.status_code != 200:
                failed.append(f"{req.rid} (HTTP {reply.status_code}: {reply.text[:200]})")
        if failed:
            raise EngineUnavailable(
                f"stopping at {self.url}: /abort_request failed for {len(failed)} of {len(requests)} requests, "
                f"which run on to their end: {'; '.join(failed[:3])}"
            )

    def _one(self, req: GenerateRequest, index: int, partial: bool = False) -> Completion:
        item, _ = post_json(
            self.client, self.url + "/generate", self.body(req), index, self._retries, headers=session_headers(req)
        )
        if not isinstance(item, dict):
            raise WireError(f"request {index}: {self.url}/generate returned {type(item).__name__}, expected an object")
        completion = self.completion(item, req, index)
        if completion.finish_reason.get("type") == "abort" and not partial:
            raise EngineUnavailable(f"completion {index}: the engine aborted it ({completion.finish_reason})")
        if partial and completion.num_tokens == 0 and _aborted(item.get("meta_info") or {}):
            return completion  # stopped before its first token: nothing sampled, nothing to check
        return validate_completion(completion, req, self.vocab_size, index, self.routing_shape)

    def generate_streaming(self, req: GenerateRequest, on_token, cancelled=None) -> Completion:
        """One request through a streamed ``/generate`` (SGLang's chunks: the ids so far, then the whole answer):
        ``on_token(id)`` for every token as it arrives; ``cancelled`` (an ``Event``) closes the stream, which
        aborts the request at the engine. No retry: tokens may have gone out already."""
        body = {**self.body(req), "stream": True}
        url = self.url + "/generate"
        seen, last = 0, None
        try:
            with self.client.stream("POST", url, json=body, headers=session_headers(req)) as reply:
                if isinstance(cancelled, Cancellation):  # set: the socket closes, and the engine aborts the request
                    cancelled.on_set(lambda: close_socket_of(reply))
                if reply.status_code != 200:
                    reply.read()
                    kind = EngineUnavailable if reply.status_code in (499, 502, 503, 504) else WireError
                    raise kind(f"request 0: {url} answered HTTP {reply.status_code}: {reply.text[:500]}")
                for line in reply.iter_lines():
                    if cancelled is not None and cancelled.is_set():
                        raise EngineUnavailable(f"request 0: the client of {url}'s stream went away")
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    last = json.loads(line[len("data: ") :])
                    if "error" in last:
                        raise EngineUnavailable(f"request 0: {url} failed the stream: {str(last['error'])[:300]}")
                    ids = last.get("output_ids") or []
                    for token in ids[seen:]:
                        on_token(token)
                    seen = len(ids)
        except httpx.HTTPError as exc:
            if cancelled is not None and cancelled.is_set():
                raise EngineUnavailable(f"request 0: the client of {url}'s stream went away") from exc
            raise EngineUnavailable(f"request 0: {url}'s stream broke: {type(exc).__name__}: {exc}") from exc
        if last is None or (last.get("meta_info") or {}).get("finish_reason") is None:
            raise EngineUnavailable(f"request 0: {url}'s stream ended before the answer")
        completion = self.completion(last, req, 0)
        if completion.finish_reason.get("type") == "abort":
            raise EngineUnavailable(f"completion 0: the engine aborted it ({completion.finish_reason})")
        return validate_completion(completion, req, self.vocab_size, 0, self.routing_shape)

    def completion(self, item: dict, req: GenerateRequest, index: int = 0) -> Completion:
        """The ``Completion`` of one ``/generate`` result object (not yet validated)."""
        where = f"completion {index}"
        try:
            output_ids = item["output_ids"]
            if not isinstance(output_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in output_ids
            ):
                raise TypeError(f"output_ids is not a list of token ids: {output_ids!r:.80}")
            meta = item["meta_info"]
            if not isinstance(meta, dict):
                raise TypeError(f"meta_info is a {type(meta).__name__}")
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"{where}: malformed /generate result ({exc})") from exc
        support = log_mu = full = row_logprobs = None
        size = 0
        if req.return_sampling_mask:
            try:
                support, log_mu, size, row_logprobs = parse_meta_info(meta, output_ids, self.vocab_size)
            except WireError as exc:
                raise WireError(f"{where}: {exc}") from exc
        if req.return_logprob:
            entries = meta.get("output_token_logprobs")
            ok = isinstance(entries, list) and all(
                isinstance(e, list) and e and isinstance(e[0], (int, float)) and not isinstance(e[0], bool)
                for e in entries
            )
            if not ok:
                raise WireError(
                    f"{where}: return_logprob was asked but meta_info has no output_token_logprobs "
                    "[[logprob, id, text], ...]"
                )
            full = np.asarray([e[0] for e in entries], np.float32)
        routed, routing_bytes, history = None, 0, None
        if req.return_routed_experts and meta.get("routed_experts") is not None:
            routed, routing_bytes = parse_routed_experts(meta["routed_experts"], self.routing_shape, where)
            history, more = parse_routing_history(meta.get("routed_experts_history"), self.routing_shape, where)
            routing_bytes += more
        return Completion(
            output_ids=output_ids,
            finish_reason=meta.get("finish_reason") or {},
            routed_experts=routed,
            routed_experts_history=history,
            routing_bytes=routing_bytes,
            support_row_logprobs=row_logprobs if req.sampling_logprobs_mode == "support" else None,
            log_mu=log_mu,
            support=support,
            full_logprobs=full,
            weight_versions=parse_weight_versions(meta, len(output_ids), where, self.per_token_versions),
            text=item["text"] if isinstance(item.get("text"), str) else "",
            support_bytes=size,
            sampler=meta.get("sampler") if req.return_sampling_mask else None,
        )
