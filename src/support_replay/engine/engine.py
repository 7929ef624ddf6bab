"""The engine: a background loop over a continuously batched set of sequences, composed of parts.

    scheduler.py       the FIFO of requests and updates, admission within the batch and the KV budget
    model_runner.py    prefill and decode over the rows' block tables (paged_cache.py, fused_step.py)
    block_pool.py      every layer's keys and values in fixed-size blocks, counted by holder
    prefix_cache.py    finished sequences' blocks, shared with later prompts that begin with them
    sampling_step.py   penalties, the core's sampler and capture (capture.py): a RowStep or RowFailure per row
    grammar.py         structured outputs: each constrained request's llguidance mask, before the filters
    stopping.py        EOS, stop tokens, stop strings, the token budget
    running.py         a running request's state and its Completion; running_batch.py, the rows decoding together
    request_checks.py  what a request is refused for before it takes a slot (a mixin of Engine: the request half)
    engine_weights.py  weights, adapters and versions queued in order with requests (a mixin: the weights half)
    pausing.py         pause and continue between decode steps (abort, retract, in_place): updates under running rows
    weight_updates.py  weights from disk or memory, checked before any is copied
    ledger.py, limits.py, kv_budget.py   counts and request ids, request limits, the KV memory budget

Each iteration admits waiting requests (prefilled together, merged into the running
batch), runs one decode step for every running sequence, samples through the replay core
(capturing S_t and log mu only for rows that asked), and finishes sequences that hit
EOS, a stop token, a stop string or their token budget. Requests and weight updates share
one FIFO: an update applies once every request submitted before it has finished, and
requests submitted after it run on the new weights (docs/engines.md); while generation is
paused (engine/pausing.py) an update applies at once and the running rows go on under it.

Admission keeps the KV pool within its budget (engine/kv_budget.py): each request reserves its
prompt plus ``max_new_tokens`` in whole blocks when it is admitted, in queue order, and waits
until it fits; prompts of like length are prefilled together.

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
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import replace

import numpy as np
import torch

from .. import __version__
from ..core.penalties import dense_bias
from ..errors import AbortedError, EngineError
from ..kernels import invariant, top_candidates
from ..modeling.batch_invariant import make_batch_invariant
from ..modeling.decode_attention import use_decode_attention
from ..modeling.linear_kernels import linear_function, resolve_linear_kernel, slow_bf16, use_linear
from ..protocol import Completion, GenerateRequest
from .block_pool import BlockPool
from .capture import keep_routing
from .decode_log import DecodeLog
from .engine_weights import EngineWeights
from .grammar import Grammars
from .kv_budget import KVBudget
from .ledger import Ledger
from .limits import EngineLimits
from .lora_adapter import AdapterSlot
from .model_runner import ModelRunner, cached_columns, load_model_and_tokenizer
from .paged_cache import PagedCache
from .pausing import Pausing
from .prefix_cache import PrefixCache
from .request_checks import RequestChecks
from .row_step import RowFailure
from .running import RunningRequest
from .running_batch import RunningBatch
from .sampling_step import SamplingStep
from .scheduler import Scheduler, prefill_buckets
from .settings import EngineSettings
from .stopping import StopConditions, eos_ids

log = logging.getLogger(__name__)


def _within_context(limits: EngineLimits, context_length: int | None) -> EngineLimits:
    """The limits with ``max_prompt_tokens`` lowered to the model's context length."""
    if context_length and limits.max_prompt_tokens > context_length:
        return replace(limits, max_prompt_tokens=int(context_length))
    return limits


class StreamedFuture(Future):
    """A request's future that also hears of every token as it is sampled (``on_token``, engine thread)."""

    def __init__(self, on_token: Callable[[int], None]):
        super().__init__()
        self.on_token = on_token

    def stream(self, token: int) -> None:
        try:
            self.on_token(token)
        except Exception:  # a listener's failure is its own: the engine and the other rows go on
            log.exception("a streaming listener failed; its request goes on unstreamed")
            self.on_token = lambda _: None


class Engine(RequestChecks, EngineWeights, Pausing):
    def __init__(self, model, tokenizer, settings: EngineSettings = EngineSettings()):
        self.settings, self.tokenizer = settings, tokenizer
        self.deterministic = settings.deterministic
        self.dtype = next(model.parameters()).dtype
        self._choose_kernels(model, settings)
        self.context_length = getattr(model.config, "max_position_embeddings", None)
        self.limits = _within_context(settings.limits, self.context_length)
        # KV positions held at the peak, in total (engine/kv_budget.py): admission waits until a request fits
        self.kv_budget = KVBudget.for_model(model, settings.max_total_tokens, settings.kv_share)
        # every row's keys and values in blocks of page_size positions (SGLang's --page-size)
        pool = BlockPool(model.config.num_hidden_layers, settings.page_size, self.kv_budget.max_total_tokens)
        self.runner = ModelRunner(model, settings.device, pool=pool)
        self.semantics, self.capacity = settings.semantics, int(settings.sampling_mask_max_tokens)
        self.vocab_size = self.runner.vocab_size
        self.eos_ids = eos_ids(model, tokenizer)
        self.weight_version = str(settings.weight_version)
        self._seed_source = torch.Generator().manual_seed(settings.seed)
        self.ledger = Ledger(self.limits.max_queue)  # queue count, request ids, aborts, counters
        self.scheduler = Scheduler(self.ledger)
        self._sampling_parts(tokenizer, settings)
        # finished rows' keys and values for later prompts that begin with them; none in the deterministic engine
        self.prefix_cache = PrefixCache(pool, enabled=settings.prefix_cache and not self.deterministic)
        pool.idle = self.prefix_cache  # cached prefixes give way to rows in place (BlockPool.allocate_rows)
        self.batch = RunningBatch(self.runner, self.prefix_cache)
        self.adapters = AdapterSlot()  # a LoRA adapter merged into the weights (SGLang's /load_lora_adapter)
        self._adapter_lock = threading.Lock()  # a load or unload and its place in the queue, together
        self.decode_log = DecodeLog(settings.decode_log_interval)  # SGLang's decode line every N steps
        self._flush_cache = False
        self._init_pausing()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._looping_here = False  # ``run``: the loop runs in a caller's thread (serve's main thread)
        self._driver = threading.Lock()  # held by whichever thread runs a step: the loop, or a caller in ``wait``

    def _choose_kernels(self, model, settings: EngineSettings) -> None:
        """The model's products and attention: the invariant arithmetic when deterministic, else the fastest."""
        if slow := slow_bf16(self.dtype, settings.device):
            log.warning("engine in bfloat16: %s", slow)
        # deterministic: what the bits of the invariant arithmetic depend on (/model_info; the trainer compares)
        self.invariant_identity: str | None = None
        if self.deterministic:  # logits independent of batch, padding and prefill/decode split, by construction
            make_batch_invariant(model, self.dtype)
            self.linear_kernel = "invariant"
            self.invariant_identity = invariant.identity()
            # every query, prefill and decode, through the decode kernel's arithmetic (kernels/invariant.attention)
            self.decode_attention = "batch-invariant"
        else:
            self.linear_kernel = resolve_linear_kernel(settings.linear_kernel, self.dtype, settings.device)
            use_linear(model, linear_function(self.linear_kernel))
            # one query token per row: the compiled CPU kernel where it runs (modeling/decode_attention.py)
            self.decode_attention = use_decode_attention(model, settings.decode_attention)

    def _sampling_parts(self, tokenizer, settings: EngineSettings) -> None:
        """Grammars, the sampling step and the stop conditions."""
        limits = self.limits
        self.grammars = Grammars(
            tokenizer,
            self.vocab_size,
            self.eos_ids,
            cached=limits.max_grammars_cached,
            seconds=limits.grammar_compile_ms / 1000,
            waiting=limits.max_grammar_compiles_waiting,
        )
        select = top_candidates.selection() if torch.device(settings.device).type == "cpu" else None
        self.sample = SamplingStep(settings.semantics, self.capacity, frozenset(self.eos_ids), self.grammars, select)
        self.stops = StopConditions(tokenizer, self.eos_ids)

    @property
    def max_batch_size(self) -> int:
        return self.limits.max_batch_size

    @classmethod
    def from_pretrained(cls, path, settings: EngineSettings = EngineSettings(), dtype=torch.float32) -> Engine:
        model, tokenizer = load_model_and_tokenizer(path, dtype, settings.device)
        return cls(model, tokenizer, settings)

    # ---- lifecycle ----------------------------------------------------------------

    def start(self) -> Engine:
        if self._thread is None:
            # a shut-down engine starts again (its loop would otherwise exit at once and strand every request)
            self._stop.clear()
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
        self.grammars.close()  # the grammar compiler's process, if one was started

    # ---- public API ---------------------------------------------------------------

    def submit(self, request: GenerateRequest, on_token: Callable[[int], None] | None = None) -> Future:
        """Queue a request; the future resolves to a ``Completion`` or raises ``EngineError``
        (400 refused, 503 queue full, 4xx/5xx when it failed). ``on_token(id)`` is called on the engine's
        thread with every token as it is sampled (streaming); a copy of a running ``rid`` streams nothing."""
        future: Future = StreamedFuture(on_token) if on_token is not None else Future()
        try:
            self.validate(request)
        except EngineError as exc:
            self.ledger.count("refused")
            future.set_exception(exc)
            return future
        answered = self.ledger.enqueue(request, future)
        if answered is not None:  # a copy of the same rid, or a full queue
            return answered
        if request.grammar is not None:
            self.grammars.hold(future, request.grammar)  # compiled by validate: admission only copies it
        self.scheduler.put("generate", request, future)
        return future

    def submit_all(self, requests: list[GenerateRequest], on_token: list | None = None) -> list[Future]:
        """Queue ``requests`` together: the loop admits them in one prefill where its batch has room,
        so a GRPO group sent at once shares its prompt's prefill (one at a time, the loop could take
        the first before the rest arrived and prefill them again, one step later)."""
        callbacks = on_token or [None] * len(requests)
        self.check_capture_budget(requests)
        self.limits.check_body(requests)
        with self.scheduler.lock:
            return [self.submit(r, cb) for r, cb in zip(requests, callbacks)]

    def abort(self, future: Future) -> None:
        """The client of ``future`` went away: drop its request, waiting or running."""
        self.ledger.abort(future)

    def stop(self, future: Future) -> bool:
        """End ``future``'s request before its next decode step with the tokens it has: answered, not failed, with
        finish reason ``{"type": "abort"}`` and its capture so far (SGLang's ``/abort_request``; partial rollouts
        keep the tokens). A request still waiting is admitted and stopped after its first token. False when it is
        neither queued nor running."""
        return self.ledger.stop(future)

    def stop_request(self, rid: str | None = None) -> int:
        """``stop`` the request named ``rid``, or every request queued or running (``None``); how many."""
        if rid is None:
            return sum(self.stop(f) for f in self.ledger.outstanding())
        future = self.ledger.running_future(rid)
        return int(future is not None and self.stop(future))

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
                    f"engine: {sum(not f.done() for f in futures)} of {len(futures)} requests not done after "
                    f"{timeout} s"
                )
            if self._thread is not None or self._looping_here:
                concurrent.futures.wait(
                    futures, timeout=left, return_when="FIRST_COMPLETED" if any_done else "ALL_COMPLETED"
                )
                continue
            self._guarded_step()

    @property
    def num_running(self) -> int:
        return len(self.batch)

    @property
    def num_waiting(self) -> int:
        return self.ledger.queued

    # ---- the loop -----------------------------------------------------------------

    def _loop(self, alive: Callable[[], bool] = lambda: True) -> None:
        # each step runs without autograd (_guarded_step), leaving the thread's grad mode alone
        while not self._stop.is_set() and alive():
            self._guarded_step()

    def _guarded_step(self) -> None:
        """One ``step`` under the driver lock; a step of the whole batch that fails fails the running
        requests and leaves the engine serving (the loop never dies, a caller in ``wait`` gets answers)."""
        with self._driver, torch.no_grad():
            try:
                self.step(block=True)
            except Exception as exc:
                log.exception("engine step failed")
                for seq in self.batch.clear():
                    self._finish_failed(
                        seq.request, seq.future, EngineError(f"internal engine error during decode: {exc}"), "decode"
                    )

    def step(self, block: bool = False) -> None:
        """One iteration: a drained weight update, admissions, one decode step (while paused, only updates)."""
        self._apply_controls()
        if self.paused is not None:
            self._flush_if_asked()
            self._step_paused(block)
            return
        updated = self.scheduler.update is not None and not self.batch
        if updated:
            self._apply_update(*self.scheduler.update)
            self.scheduler.update = None
        self._flush_if_asked()
        admitted = []
        if self.scheduler.update is None:
            room = self.max_batch_size - len(self.batch)
            # a step that applied an update returns at once: its caller (a colocated trainer's push) is done
            idle = block and not self.batch and not updated
            admitted = self.scheduler.take(room, idle, self._fits, self._aborted_waiting)
        if admitted:
            self._flush_if_asked()  # a flush asked while the loop waited for work comes before what arrived after it
            self._admit(admitted)
        if self.batch:
            self._decode()

    def _flush_if_asked(self) -> None:
        if self._flush_cache:
            self._flush_cache = False
            self.prefix_cache.clear()

    def _aborted_waiting(self, request: GenerateRequest, future: Future, why: str) -> None:
        self._finish_failed(request, future, AbortedError(f"{why} before the request started"), "aborted")

    def _fits(self, taken: list[GenerateRequest], request: GenerateRequest) -> bool:
        """Whether ``request``, admitted with ``taken``, keeps the KV cache's peak within the budget."""
        joining = [*taken, request]
        needs = [self._column_need(r) for r in joining]
        width = max([s.need for s in self.batch.rows] + needs)  # a reservation is whole blocks
        # the prefills run bucket after bucket (scheduler.prefill_buckets), each padded to its longest prompt
        buckets = prefill_buckets(joining, length=lambda r: len(r.input_ids))
        prefill = max(len(b) * max(len(r.input_ids) for r in b) for b in buckets)
        budget, rows = self.kv_budget, len(self.batch) + len(joining)

        def peak() -> int:
            return budget.peak(self.batch.committed(), needs, prefill, rows, width)

        while peak() > budget.max_total_tokens and self.prefix_cache.entries:  # cached prefixes give way
            self.prefix_cache.evict_oldest()
        if self.batch and self.batch.captured_ids() > self.limits.max_capture_ids_running:
            return False  # the running rows hold their capture budget: the request waits for some to finish
        return peak() <= budget.max_total_tokens

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
                    RunningRequest(
                        request,
                        future,
                        torch.Generator().manual_seed(seed),
                        position=len(request.input_ids),
                        bias=bias,
                        need=self._column_need(request),
                        grammar=self.grammars.matcher(request.grammar, future) if request.grammar is not None else None,
                        epoch=self.prefix_cache.epoch,
                    )
                )
            except Exception as exc:
                self._finish_failed(request, future, exc, "admission")
        if not seqs:
            return
        self._prefill_and_join(seqs)

    def _prefill_and_join(self, seqs: list[RunningRequest]) -> None:
        """Prefill ``seqs`` bucket by bucket and join them to the batch; where a bucket fails, one by one, and a
        row that fails alone fails its request."""
        for bucket in prefill_buckets(seqs, length=lambda s: len(s.fed_ids())):  # like lengths: little padding
            try:
                groups = [(bucket, *self._prefill(bucket))]
            except Exception:
                log.exception("prefill of %d requests failed; prefilling them one by one", len(bucket))
                groups = []
                for seq in bucket:
                    try:
                        groups.append(([seq], *self._prefill([seq])))
                    except Exception as exc:
                        self._finish_failed(seq.request, seq.future, exc, "prefill")
            for group, batch, logits in groups:
                self._join(group, batch, logits)

    def _prefill(self, group: list[RunningRequest]) -> tuple[PagedCache, torch.Tensor]:
        """The group's prompts prefilled together; where prompts begin with cached prefixes, the batch
        computes only the columns past them (engine/prefix_cache.py, ``model_runner.cached_columns``).
        The rows that asked keep their prompts' routing (a hit's cached positions report the routing
        their entry kept)."""
        prompts = [s.fed_ids() for s in group]
        matches = [self.prefix_cache.match(p, routing=s.request.return_routed_experts) for p, s in zip(prompts, group)]
        routing = any(s.request.return_routed_experts for s in group)
        page = self.runner.pool.block_size
        reserve = [s.need // page for s in group]  # each row's whole reservation: runs of blocks at one pitch
        cached = [None if entry is None else (entry, n) for entry, n in matches]
        cache, logits = self.runner.prefill(prompts, routing=routing, reserve=reserve, cached=cached)
        self.prefix_cache.count(prompts, cached_columns([len(p) for p in prompts], [n for _, n in matches]))
        if routing:
            keep_routing(group, self.runner.routing_rows)
        return cache, logits

    def _recompute(self, rows: list[RunningRequest]) -> None:
        """Retracted rows back into the batch (engine/pausing.py): their prompt and outputs prefilled again under
        the current weights, then each samples its next token from those logits. A row's routing becomes the
        recompute's (the forward its later tokens follow); the one its earlier tokens followed is kept in its
        routing history (routing replay scores each token under the routing that computed it)."""
        for seq in rows:
            if seq.request.return_routed_experts and seq.routing:
                seq.routing_history.append(np.concatenate(seq.routing))
            seq.position, seq.epoch, seq.routing = len(seq.fed_ids()), self.prefix_cache.epoch, []
        self._prefill_and_join(rows)

    def _join(self, group: list[RunningRequest], cache: PagedCache, logits: torch.Tensor) -> None:
        """A prefilled group joins the running batch and samples its first tokens."""
        self.batch.join(group, cache)
        self._sample_and_advance(group, logits)

    def _decode(self) -> None:
        rows = self.batch.rows
        why = self.ledger.aborted([s.future for s in rows])
        gone = [s for s in rows if s.future in why]
        for seq in gone:  # cancelled by their clients or a weight update: stop spending steps on them
            seq.fail(AbortedError(why[seq.future]), "aborted")
        stopped = self.ledger.stopped([s.future for s in rows if s.future not in why])
        for seq in rows:
            if seq.future in stopped:  # answered with what they have (Engine.stop)
                seq.finish_reason = {"type": "abort", "message": "stopped by /abort_request: the tokens so far"}
                gone.append(seq)
        if gone:
            self._retire()
            if not self.batch:
                return
        self._sample_and_advance(self.batch.rows, self.batch.decode())
        if self.decode_log.interval:
            tokens = sum(len(s.request.input_ids) + len(s.output_ids) for s in self.batch.rows)
            self.decode_log.step(len(self.batch), tokens, self.kv_budget.max_total_tokens, self.ledger.queued)

    def _sample_and_advance(self, seqs: list[RunningRequest], logits: torch.Tensor) -> None:
        """Sample one token for every sequence and record it; a row that fails fails its request alone."""
        for seq, row in zip(seqs, self.sample(seqs, logits)):
            if isinstance(row, RowFailure):
                seq.fail(row.error, row.where)
                continue
            seq.record(row)
            if seq.grammar is not None:
                try:
                    self.grammars.advance(seq.grammar, row.token)
                except Exception as exc:
                    seq.fail(exc, "grammar")
                    continue
            self.stops.check(seq, row.token)
            if isinstance(seq.future, StreamedFuture):
                seq.future.stream(row.token)
        self._retire()

    def _retire(self) -> None:
        for seq in self.batch.retire():  # answered after their rows left: a client that hears back sees the slot free
            if seq.failure is not None:
                self._finish_failed(seq.request, seq.future, *seq.failure)
            elif not seq.future.done():
                self._finish_ok(
                    seq.request,
                    seq.future,
                    seq.completion(self.tokenizer, self.weight_version, self.semantics, __version__),
                )

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
