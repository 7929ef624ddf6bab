"""The engine: a background loop over a continuously batched set of sequences.

Each iteration admits waiting requests (prefilled together, merged into the running
batch), runs one decode step for every running sequence, samples through the replay core
(capturing S_t and log mu only for rows that asked), and finishes sequences that hit
EOS, a stop token, a stop string or their token budget. Requests and weight updates share
one FIFO: an update applies once every request submitted before it has finished, and
requests submitted after it run on the new weights (docs/engines.md).

Admission keeps the KV cache within its budget (engine/kv_budget.py): each request reserves its
prompt plus ``max_new_tokens`` when it is admitted, in queue order, and waits until it fits;
prompts of like length are prefilled together.

One request never takes others down (docs/reliability.md): a request outside the limits is
refused before it takes a slot (400), a full queue answers 503, and an error while admitting,
prefilling, sampling or capturing one request fails that request alone, the rows batched with
it going on as if it had not been there. A request whose realized support exceeds the capacity
fails alone with ``CapacityError``; nothing of it is returned. A request id (``rid``) seen
again while its first copy runs, or shortly after it finished, gets that copy's answer.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

from ..core.logprobs import full_logprobs, support_row_logprobs
from ..core.penalties import dense_bias, dense_history, penalise
from ..core.sampling import sample_tokens
from ..core.support import SupportTable
from ..errors import AbortedError, CapacityError, EngineError, RequestError, SamplingParamsError
from ..modeling.batch_invariant import KEY_BLOCK, make_batch_invariant
from ..modeling.invariant_products import model_plans
from ..modeling.linear_kernels import linear_function, resolve_linear_kernel, use_linear
from ..protocol import (
    DEFAULT_SAMPLING_MASK_MAX_TOKENS,
    DEFAULT_WEIGHT_VERSION,
    Completion,
    GenerateRequest,
    single_version,
)
from .kv_budget import SERVE_SHARE, KVBudget, column_need, plan_shape
from .ledger import Ledger
from .limits import EngineLimits
from .model_runner import ModelRunner, load_model_and_tokenizer
from .slot_cache import SlotCache

log = logging.getLogger(__name__)

UTF8_MAX_BYTES = 4  # a character is at most 4 bytes: a byte-level token run longer than that never completes one


@dataclass
class _Sequence:
    """Engine-side state of one running request."""

    request: GenerateRequest
    future: Future
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    log_mu: list[float] = field(default_factory=list)
    supports: list[np.ndarray] = field(default_factory=list)  # one canonical id array per token
    full_logprobs: list[float] = field(default_factory=list)
    support_row_logprobs: list[np.ndarray] = field(default_factory=list)
    position: int = 0  # position id of the next token fed to the model
    finish_reason: dict | None = None
    text: str = ""
    decoded: str = ""  # the output's text so far, decoded incrementally (stop strings)
    decode_from: tuple[int, int] = (0, 0)  # (prefix, read) token offsets of the incremental decode
    bias: tuple[torch.Tensor, torch.Tensor] | None = None  # the request's logit bias as a row, built once at admission
    failure: tuple[Exception, str] | None = None  # why it stopped early, answered once its row has left the batch
    need: int = 0  # cache columns reserved for it: prompt + max_new_tokens + the write column (engine/kv_budget.py)


PREFILL_PADDING = 2.0  # a prefill batch computes at most this many positions per real prompt token


def prefill_buckets(seqs: list[_Sequence]) -> list[list[_Sequence]]:
    """``seqs`` in groups prefilled together: by prompt length, a group closing when left-padding it
    to its longest prompt would compute more than ``PREFILL_PADDING`` times its real tokens (one
    8,000-token prompt admitted with ten short ones would otherwise pad all eleven to 8,000). A
    GRPO group (one prompt, n times) stays whole: equal lengths pad nothing."""
    buckets, current, real = [], [], 0
    for seq in sorted(seqs, key=lambda s: len(s.request.input_ids)):
        n = len(seq.request.input_ids)
        if current and (len(current) + 1) * n > PREFILL_PADDING * (real + n):
            buckets.append(current)
            current, real = [], 0
        current.append(seq)
        real += n
    return buckets + [current] if current else buckets


class Engine:
    def __init__(
        self,
        model,
        tokenizer,
        *,
        semantics: str = "sglang",
        sampling_mask_max_tokens: int = DEFAULT_SAMPLING_MASK_MAX_TOKENS,
        limits: EngineLimits | None = None,
        seed: int = 0,
        device: str = "cpu",
        deterministic: bool = False,
        weight_version: str = DEFAULT_WEIGHT_VERSION,
        linear_kernel: str = "auto",
        max_total_tokens: int | None = None,
        kv_share: float = SERVE_SHARE,
    ):
        dtype = next(model.parameters()).dtype
        self.linear_kernel = resolve_linear_kernel(linear_kernel, dtype, device)
        self.invariant_plans: dict[str, str] = {}  # deterministic: each linear shape's probed plan (/model_info)
        if deterministic:  # logits independent of batch, padding and prefill/decode split
            make_batch_invariant(model, self.linear_kernel)
            self.invariant_plans = {
                shape: plan.describe() for shape, plan in model_plans(model, self.linear_kernel).items()
            }
        else:
            use_linear(model, linear_function(self.linear_kernel))
        self.deterministic = deterministic
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        limits = limits or EngineLimits()
        if self.context_length and limits.max_prompt_tokens > self.context_length:
            limits = EngineLimits(**{**limits.to_json(), "max_prompt_tokens": int(self.context_length)})
        self.limits = limits
        # KV positions held at the peak, in total (engine/kv_budget.py): admission waits until a request fits
        self.kv_budget = KVBudget.for_model(model, max_total_tokens, kv_share)
        self.runner = ModelRunner(
            model,
            device,
            key_block=KEY_BLOCK if deterministic else 1,
            max_rows=limits.max_batch_size,
            max_tokens=self.kv_budget.max_total_tokens,
        )
        self.tokenizer = tokenizer
        self.semantics = semantics
        self.capacity = int(sampling_mask_max_tokens)
        self.vocab_size = self.runner.vocab_size
        self.eos_ids = self._eos_ids(model, tokenizer)
        self.weight_version = str(weight_version)
        self._seed_source = torch.Generator().manual_seed(seed)
        self._inbox: queue.Queue = queue.Queue()  # ("generate" | "update", payload, future)
        self._deferred: list = []  # inbox items taken out but not yet admitted (the KV budget had no room): first in line
        self._update: tuple | None = None  # an update waiting for the batch to drain
        self._running: list[_Sequence] = []
        self._batch: SlotCache | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._looping_here = False  # ``run``: the loop runs in a caller's thread (serve's main thread)
        self._admission = threading.Lock()  # held while a list is queued and while the loop drains the inbox
        self._driver = threading.Lock()  # held by whichever thread runs a step: the loop, or a caller in ``wait``
        self.ledger = Ledger(self.limits.max_queue)  # queue count, request ids, aborts, counters

    @property
    def max_batch_size(self) -> int:
        return self.limits.max_batch_size

    @classmethod
    def from_pretrained(cls, path, dtype=torch.float32, device: str = "cpu", **kwargs) -> Engine:
        model, tokenizer = load_model_and_tokenizer(path, dtype, device)
        return cls(model, tokenizer, device=device, **kwargs)

    @staticmethod
    def _eos_ids(model, tokenizer) -> set[int]:
        ids = set()
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        for value in (gen_eos, getattr(model.config, "eos_token_id", None), tokenizer.eos_token_id):
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, (list, tuple)):
                ids.update(int(v) for v in value)
        return ids

    # ---- lifecycle ----------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            self._stop.clear()  # a shut-down engine starts again (its loop would otherwise exit at once and strand every request)
            self._thread = threading.Thread(target=self._loop, name="support-replay-engine", daemon=True)
            self._thread.start()
        return self

    def run(self, alive: Callable[[], bool] = lambda: True) -> None:
        """The loop in this thread until ``shutdown`` (from another thread or a signal handler) or
        until ``alive()`` turns false (checked every step: ``serve`` stops when its HTTP thread
        dies). ``serve`` runs it on the main thread, which loaded the model: one OpenMP pool
        computes (see ``wait``), and the HTTP server takes a thread of its own."""
        self._stop.clear()
        self._looping_here = True
        try:
            self._loop(alive)
        finally:
            self._looping_here = False

    def shutdown(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    # ---- public API ---------------------------------------------------------------

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
        try:
            request.penalties.check(self.semantics, self.vocab_size)
        except SamplingParamsError as exc:
            raise RequestError(f"sampling_params: {exc} (engine semantics {self.semantics})") from exc
        self.limits.validate(request, self.context_length)
        self.kv_budget.check_alone(len(request.input_ids), self._column_need(request))

    def _column_need(self, request: GenerateRequest) -> int:
        return column_need(len(request.input_ids), request.max_new_tokens, self.runner.key_block)

    def submit(self, request: GenerateRequest) -> Future:
        """Queue a request; the future resolves to a ``Completion`` or raises ``EngineError``
        (400 refused, 503 queue full, 4xx/5xx when it failed)."""
        future: Future = Future()
        try:
            self.validate(request)
        except EngineError as exc:
            self.ledger.count("refused")
            future.set_exception(exc)
            return future
        answered = self.ledger.enqueue(request, future)
        if answered is not None:  # a copy of the same rid, or a full queue
            return answered
        self._inbox.put(("generate", request, future))
        return future

    def submit_all(self, requests: list[GenerateRequest]) -> list[Future]:
        """Queue ``requests`` together: the loop admits them in one prefill where its batch has room,
        so a GRPO group sent at once shares its prompt's prefill (one at a time, the loop could take
        the first before the rest arrived and prefill them again, one step later)."""
        with self._admission:
            return [self.submit(r) for r in requests]

    def abort(self, future: Future) -> None:
        """The client of ``future`` went away: drop its request, waiting or running."""
        self.ledger.abort(future)

    @property
    def stats(self):
        return self.ledger.stats

    def generate(self, requests: list[GenerateRequest], timeout: float | None = None) -> list[Completion]:
        """Blocking convenience: submit all, wait for all (``wait``: this thread runs the steps
        unless the loop was started)."""
        futures = self.submit_all(requests)
        self.wait(futures, timeout)
        return [f.result() for f in futures]

    def wait(self, futures: list[Future], timeout: float | None = None, *, any_done: bool = False) -> None:
        """Return once every future is done, or one of them with ``any_done`` (``TimeoutError`` after
        ``timeout`` seconds). With the loop started, its thread serves them; without it, this thread
        runs the engine's steps (one thread at a time; what other threads queued is served in the same steps).

        Why the caller's thread: PyTorch's CPU ops run on libgomp, and a second thread that
        computes gets its own OpenMP pool; with more pool threads than CPUs libgomp cuts every
        pool's spin-wait to a few hundred iterations, so each parallel product pays a futex
        wake-up. Measured here (2 cores): a thread's linear products run ~10% slower while
        another thread holds a pool, the trainer's as much as the engine's (docs/benchmarks.md).
        A colocated engine therefore steps in the thread that calls it."""
        deadline = None if timeout is None else time.monotonic() + timeout
        settled = any if any_done else all
        while futures and not settled(f.done() for f in futures):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise TimeoutError(
                    f"engine: {sum(not f.done() for f in futures)} of {len(futures)} requests not done after {timeout} s"
                )
            if self._thread is not None or self._looping_here:
                concurrent.futures.wait(
                    futures, timeout=left, return_when="FIRST_COMPLETED" if any_done else "ALL_COMPLETED"
                )
                continue
            self._guarded_step()

    def update_weights_from_disk(
        self, path: str | Path, version: str | None = None, *, abort_all_requests: bool = False
    ) -> Future:
        """Load safetensors weights once the running batch has drained; resolves to the version.

        ``version`` names the new weights (the trainer's string); without one the engine
        keeps its current name, as SGLang does. ``abort_all_requests`` (SGLang's field) fails
        every request queued or running now with ``AbortedError`` instead of letting them
        finish on the old weights, so the update applies at the next step.
        """
        return self._queue_update(Path(path), version, abort_all_requests)

    def update_weights(
        self, state_dict: dict[str, torch.Tensor], version: str | None = None, *, abort_all_requests: bool = False
    ) -> Future:
        """Same as ``update_weights_from_disk`` with tensors in memory (colocated trainer)."""
        return self._queue_update(state_dict, version, abort_all_requests)

    def _queue_update(self, source, version: str | None, abort_all_requests: bool) -> Future:
        future: Future = Future()
        if abort_all_requests:
            aborted = self.ledger.abort_all()
            log.info("weight update to %s aborts %d requests", version, aborted)
        self._inbox.put(("update", (source, version), future))
        return future

    def update_weight_version(self, version: str) -> Future:
        """Rename the current weights (SGLang's ``/update_weight_version``), in queue order like an update."""
        future: Future = Future()
        self._inbox.put(("update", (None, version), future))
        return future

    def release_packed_weights(self) -> None:
        """Frees the decode step's packed weight copies (engine/fused_step.py) until the next decode
        step packs them again. A colocated trainer calls it before it trains: its weight push makes
        them stale anyway, and the update's peak memory need not hold them. Safe beside a running
        step: a step keeps the packs it started with, and a missing pack means the plain weight."""
        if self.runner.fused is not None:
            self.runner.fused.drop_packs()

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return self.ledger.queued

    # ---- the loop -----------------------------------------------------------------

    def _loop(self, alive: Callable[[], bool] = lambda: True) -> None:
        while (
            not self._stop.is_set() and alive()
        ):  # each step runs without autograd (_guarded_step), leaving the thread's grad mode alone
            self._guarded_step()

    def _guarded_step(self) -> None:
        """One ``step`` under the driver lock; a step of the whole batch that fails fails the running
        requests and leaves the engine serving (the loop never dies, a caller in ``wait`` gets answers)."""
        with self._driver, torch.no_grad():
            try:
                self.step(block=True)
            except Exception as exc:
                log.exception("engine step failed")
                failed, self._running, self._batch = self._running, [], None
                for seq in failed:
                    self._finish_failed(
                        seq.request, seq.future, EngineError(f"internal engine error during decode: {exc}"), "decode"
                    )

    def step(self, block: bool = False) -> None:
        """One iteration: a drained weight update, admissions, one decode step."""
        if self._update is not None and not self._running:
            self._apply_update(*self._update)
            self._update = None
        admitted = self._take_waiting(block and not self._running) if self._update is None else []
        if admitted:
            self._admit(admitted)
        if self._running:
            self._decode()

    def _apply_update(self, arg, future) -> None:
        source, version = arg
        try:
            if source is not None:
                self._load_state(_load_safetensors(source) if isinstance(source, Path) else source)
            if version is not None:
                self.weight_version = str(version)
            future.set_result(self.weight_version)
        except Exception as exc:
            future.set_exception(exc if isinstance(exc, EngineError) else EngineError(f"update_weights: {exc}"))

    def _load_state(self, state: dict[str, torch.Tensor]) -> None:
        params = self.runner.model.state_dict(keep_vars=True)  # tied weights appear under every name
        unknown = [k for k in state if k not in params]
        if unknown:
            raise RequestError(f"unknown parameter {unknown[0]!r} ({len(unknown)} in all)")
        for name, tensor in state.items():
            if params[name].shape != tensor.shape:
                raise RequestError(f"parameter {name!r}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor)

    def _take_waiting(self, block: bool) -> list:
        """Pop requests in order until the batch is full, the KV budget has no room for the next one
        (it waits, first in line), or an update is next in line."""
        room = self.max_batch_size - len(self._running)
        taken = []
        if room <= 0:
            return taken
        try:
            item = (
                self._deferred.pop(0)
                if self._deferred
                else (self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait())
            )
        except queue.Empty:
            return taken
        with self._admission:  # a list being queued (submit_all) is whole before the rest is drained
            while True:
                kind, payload, future = item
                if kind == "update":
                    self._update = (payload, future)
                    break
                if not self.ledger.aborted([future]) and not self._fits(taken, payload):
                    self._deferred.insert(0, item)
                    break
                why = self.ledger.dequeue(future)
                if why is not None:
                    self._finish_failed(payload, future, AbortedError(f"{why} before the request started"), "aborted")
                elif future.set_running_or_notify_cancel():
                    taken.append((payload, future))
                if len(taken) >= room:
                    break
                try:
                    item = self._deferred.pop(0) if self._deferred else self._inbox.get_nowait()
                except queue.Empty:
                    break
        return taken

    def _fits(self, taken: list, request: GenerateRequest) -> bool:
        """Whether ``request``, admitted with ``taken``, keeps the KV cache's peak within the budget."""
        joining = [r for r, _ in taken] + [request]
        held = (self._batch.slots, self._batch.capacity) if self._batch is not None else (0, 0)
        need = max([s.need for s in self._running] + [self._column_need(r) for r in joining])
        budget = self.kv_budget
        shape = plan_shape(held, len(self._running) + len(joining), need, self.max_batch_size, budget.max_total_tokens)
        return budget.peak(held, shape, len(joining), max(len(r.input_ids) for r in joining)) <= budget.max_total_tokens

    def _admit(self, admitted) -> None:
        """Prefill the new requests together; one that fails (its seed, its prompt) fails alone."""
        seqs = []
        for request, future in admitted:
            try:
                seed = request.params.seed
                if seed is None:
                    seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source))
                bias = dense_bias(request.penalties, self.vocab_size, self.runner.device)
                seqs.append(
                    _Sequence(
                        request,
                        future,
                        torch.Generator().manual_seed(seed),
                        position=len(request.input_ids),
                        bias=bias,
                        need=self._column_need(request),
                    )
                )
            except Exception as exc:
                self._finish_failed(request, future, exc, "admission")
        if not seqs:
            return
        for bucket in prefill_buckets(seqs):  # prompts of like length together: the left padding stays small
            try:
                groups = [(bucket, *self.runner.prefill([s.request.input_ids for s in bucket]))]
            except Exception:
                log.exception("prefill of %d requests failed; prefilling them one by one", len(bucket))
                groups = []
                for seq in bucket:
                    try:
                        groups.append(([seq], *self.runner.prefill([seq.request.input_ids])))
                    except Exception as exc:
                        self._finish_failed(seq.request, seq.future, exc, "prefill")
            for group, batch, logits in groups:
                self._join(group, batch, logits)

    def _join(self, group: list[_Sequence], batch: SlotCache, logits: torch.Tensor) -> None:
        """A prefilled group joins the running batch and samples its first tokens."""
        # every row's reservation at once, in the shape admission counted: the cache never grows while it decodes
        need = max(s.need for s in self._running + group)
        if self._batch is not None:
            self._batch.reserve(self._batch.size + len(group), need, batch.layers[0].k)
        self._batch = self.runner.merge(self._batch, batch)
        self._batch.reserve(self._batch.size, need, batch.layers[0].k)
        self._running.extend(group)
        self._sample_and_advance(group, logits)

    def _decode(self) -> None:
        why = self.ledger.aborted([s.future for s in self._running])
        gone = [s for s in self._running if s.future in why]
        for seq in gone:  # cancelled by their clients or a weight update: stop spending steps on them
            seq.finish_reason, seq.failure = {"type": "abort"}, (AbortedError(why[seq.future]), "aborted")
        if gone:
            self._retire()
            if not self._running:
                return
        last = torch.tensor([s.output_ids[-1] for s in self._running])
        positions = torch.tensor([s.position for s in self._running])
        logits = self.runner.decode(self._batch, last, positions)
        for s in self._running:
            s.position += 1
        self._sample_and_advance(self._running, logits)

    def _sample_and_advance(self, seqs: list[_Sequence], logits: torch.Tensor) -> None:
        """Sample one token for every sequence and record it; a row that fails fails its request alone."""
        try:
            steps = self._draw(seqs, logits)
        except Exception:
            log.exception("sampling %d rows failed; sampling them one by one", len(seqs))
            steps = []
            for row, seq in enumerate(seqs):
                try:
                    steps += self._draw([seq], logits[row : row + 1])
                except Exception as exc:
                    steps.append(exc)
        for seq, step in zip(seqs, steps):
            if isinstance(step, Exception):
                seq.finish_reason, seq.failure = (
                    {"type": "abort"},
                    (step, "capture" if isinstance(step, CapacityError) else "sampling"),
                )
                continue
            token, support, log_mu, full, row_logprobs = step
            if support is not None:
                seq.supports.append(support)
                seq.log_mu.append(log_mu)
                if row_logprobs is not None:
                    seq.support_row_logprobs.append(row_logprobs)
            if full is not None:
                seq.full_logprobs.append(full)
            seq.output_ids.append(token)
            self._check_finished(seq, token)
        self._retire()

    def _draw(self, seqs: list[_Sequence], logits: torch.Tensor) -> list:
        """Per row: ``(token, support ids, log mu, full log-prob, support-mode log-probs)``, or the
        exception that row's capture raised."""
        logits = self._penalised(seqs, logits)
        out = sample_tokens(
            logits,
            [s.request.params for s in seqs],
            self.semantics,
            generator=[s.generator for s in seqs],
            capture=[s.request.return_sampling_mask for s in seqs],
        )
        full = self._full_logprobs(seqs, logits, out.tokens)
        captured = dict(zip(out.captured.tolist(), range(len(out.captured))))
        sizes, offsets, ids = out.support.sizes(), out.support.offsets, out.support.ids
        log_mu, tokens = out.log_mu.tolist(), out.tokens.tolist()
        steps = []
        for row, seq in enumerate(seqs):
            i = captured.get(row)
            support = lp = row_logprobs = None
            if i is not None:
                if sizes[i] > self.capacity:
                    steps.append(
                        CapacityError(
                            f"realized support of {int(sizes[i])} tokens at output position {len(seq.output_ids)} "
                            f"exceeds sampling_mask_max_tokens={self.capacity}; nothing of this request is returned"
                        )
                    )
                    continue
                support, lp = ids[offsets[i] : offsets[i + 1]], log_mu[i]
                if seq.request.sampling_logprobs_mode == "support":
                    row_logprobs = self._support_row_logprobs(logits[row], support, seq.request.params)
            steps.append((tokens[row], support, lp, None if full is None else full.get(row), row_logprobs))
        return steps

    def _penalised(self, seqs: list[_Sequence], logits: torch.Tensor) -> torch.Tensor:
        """Penalties and logit bias of the rows that have them, over each request's own history
        (penalties.penalise, the trainer's transform); the filters and log mu see the result."""
        rows = [i for i, s in enumerate(seqs) if s.request.penalties.active]
        if not rows:
            return logits
        logits = logits.clone()
        vocab = logits.shape[1]
        for i in rows:
            req = seqs[i].request
            counts, seen = dense_history(req.input_ids, seqs[i].output_ids, vocab, self.semantics, logits.device)
            logits[i] = penalise(logits[i].float(), counts, seen, seqs[i].bias, req.penalties, self.semantics).to(
                logits.dtype
            )
        return logits

    @staticmethod
    def _support_row_logprobs(logits_row: torch.Tensor, row_ids: np.ndarray, params) -> np.ndarray:
        """log mu of every id of the support, in O(|S|), with the selected token's bits."""
        return support_row_logprobs(
            logits_row, torch.from_numpy(row_ids.astype(np.int64)), params.temperature or 1.0
        ).numpy()

    def _full_logprobs(self, seqs, logits, tokens) -> dict[int, float] | None:
        rows = [i for i, s in enumerate(seqs) if s.request.return_logprob]
        if not rows:
            return None
        index = torch.tensor(rows)
        temps = torch.tensor([seqs[i].request.params.temperature or 1.0 for i in rows])
        logp = full_logprobs(
            logits[index], tokens[index], temps
        )  # the trainer's function, so they can agree bit for bit
        return dict(zip(rows, logp.tolist()))

    def _check_finished(self, seq: _Sequence, token: int) -> None:
        req = seq.request
        if not req.ignore_eos and token in self.eos_ids:
            seq.finish_reason = {"type": "stop", "matched": token}
        elif token in req.stop_token_ids:
            seq.finish_reason = {"type": "stop", "matched": token}
        elif req.stop:
            new = self._decode_new_text(seq)
            if new:  # a stop string not seen before ends in the new text: search only there
                start = max(0, len(seq.decoded) - new - max(map(len, req.stop)) + 1)
                window = seq.decoded[start:]
                hits = [(window.find(s), s) for s in req.stop if s and s in window]
                if hits:
                    pos, matched = min(hits)
                    seq.text = seq.decoded[: start + pos]
                    seq.finish_reason = {"type": "stop", "matched": matched}
        if seq.finish_reason is None and len(seq.output_ids) >= req.max_new_tokens:
            seq.finish_reason = {"type": "length", "length": len(seq.output_ids)}

    def _decode_new_text(self, seq: _Sequence) -> int:
        """Append the text the newest tokens add to ``seq.decoded``; returns how many characters.
        Decodes a few tokens per step (vLLM's incremental rule: the text of ``[prefix:]`` past that of
        ``[prefix:read]``), not the whole output, and waits while a token may end inside a UTF-8
        character (up to 4 tokens: a longer invalid run is final)."""
        prefix, read = seq.decode_from
        ids = seq.output_ids
        before = self.tokenizer.decode(ids[prefix:read], skip_special_tokens=True)
        text = self.tokenizer.decode(ids[prefix:], skip_special_tokens=True)
        if text.endswith("\ufffd") and len(ids) - read < UTF8_MAX_BYTES:  # an incomplete character may still end
            return 0
        new = text[len(before) :]
        seq.decoded += new
        seq.decode_from = (read, len(ids))
        return len(new)

    def _retire(self) -> None:
        keep = [i for i, s in enumerate(self._running) if s.finish_reason is None]
        if len(keep) == len(self._running):
            return
        done = [s for s in self._running if s.finish_reason is not None]
        self._batch, order = self.runner.keep(self._batch, keep)  # a leaving row's slot takes the last row
        self._running = [self._running[i] for i in order]
        if (
            self._batch is not None
        ):  # the rows that needed the most room may have left: hold no more than the rest reserved
            self._batch.shrink(max(s.need for s in self._running))
        for seq in done:  # answered after their rows left: a client that hears back sees the slot free
            if seq.failure is not None:
                self._finish_failed(seq.request, seq.future, *seq.failure)
            elif not seq.future.done():
                self._finish_ok(seq.request, seq.future, self._result(seq))

    # ---- answers ------------------------------------------------------------------

    def _finish_ok(self, request: GenerateRequest, future: Future, completion: Completion) -> None:
        self.ledger.finished(request, future, completion)
        future.set_result(completion)

    def _finish_failed(self, request: GenerateRequest, future: Future, exc: Exception, where: str) -> None:
        """Fail one request, naming where; an unexpected error becomes a 500 that says so."""
        if not isinstance(exc, EngineError):
            log.warning("request failed at %s: %s", where, exc)
            exc = EngineError(f"the request failed during {where}: {type(exc).__name__}: {exc}")
        self.ledger.failed(request, future, exc)
        if not future.done():
            future.set_exception(exc)

    def _result(self, seq: _Sequence) -> Completion:
        req = seq.request
        text = (
            seq.text
            if seq.finish_reason.get("type") == "stop" and isinstance(seq.finish_reason.get("matched"), str)
            else None
        )
        if text is None:
            text = self.tokenizer.decode(seq.output_ids, skip_special_tokens=True)
        capture = req.return_sampling_mask
        return Completion(
            output_ids=list(seq.output_ids),
            finish_reason=seq.finish_reason,
            log_mu=np.asarray(seq.log_mu, np.float32) if capture else None,
            support=SupportTable.from_rows(seq.supports) if capture else None,
            full_logprobs=np.asarray(seq.full_logprobs, np.float32) if req.return_logprob else None,
            # an update waits for the running batch to drain: one version per response
            weight_versions=single_version(self.weight_version, len(seq.output_ids)),
            text=text,
            support_row_logprobs=list(seq.support_row_logprobs)
            if capture and req.sampling_logprobs_mode == "support"
            else None,
        )


def _load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    files = [path] if path.is_file() else sorted(path.glob("*.safetensors")) if path.is_dir() else []
    if not files:
        raise RequestError(f"model_path: no .safetensors file at {path}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state
