"""The engine's small parts on their own: the scheduler's order and admission, prefill buckets,
stop conditions, and the running request's record (engine/scheduler.py, stopping.py, running.py)."""

from concurrent.futures import Future

import numpy as np
import torch

from support_replay import SamplingParams
from support_replay.engine.ledger import Ledger
from support_replay.engine.row_step import RowStep
from support_replay.engine.running import RunningRequest
from support_replay.engine.scheduler import PREFILL_PADDING, Scheduler, prefill_buckets
from support_replay.engine.stopping import StopConditions
from support_replay.protocol import GenerateRequest


def request(n_prompt=3, **kw):
    return GenerateRequest(list(range(1, n_prompt + 1)), SamplingParams(top_k=4), **kw)


def running(req):
    return RunningRequest(req, Future(), torch.Generator().manual_seed(0), position=len(req.input_ids))


def queued(scheduler, req):
    future = Future()
    assert scheduler.ledger.enqueue(req, future) is None
    scheduler.put("generate", req, future)
    return future


def test_requests_and_updates_are_taken_in_order_and_a_request_that_does_not_fit_waits_first_in_line():
    scheduler = Scheduler(Ledger(max_queue=16))
    first, second = request(), request()
    queued(scheduler, first)
    scheduler.put("update", ("weights", "v1"), Future())
    queued(scheduler, second)
    never = lambda taken, req: True
    taken = scheduler.take(room=8, block=False, fits=never, aborted=None)
    assert [r for r, _ in taken] == [first] and scheduler.update[0] == ("weights", "v1")
    scheduler.update = None
    full = lambda taken, req: False  # the KV budget has no room: the request waits, first in line
    assert scheduler.take(room=8, block=False, fits=full, aborted=None) == []
    assert [r for r, _ in scheduler.take(room=8, block=False, fits=never, aborted=None)] == [second]
    assert scheduler.take(room=8, block=False, fits=never, aborted=None) == []


def test_an_aborted_request_is_answered_not_admitted():
    scheduler = Scheduler(Ledger(max_queue=16))
    req = request()
    future = queued(scheduler, req)
    scheduler.ledger.abort(future)
    seen = []
    taken = scheduler.take(room=8, block=False, fits=lambda t, r: True, aborted=lambda r, f, why: seen.append(why))
    assert taken == [] and len(seen) == 1


def test_prefill_buckets_keep_groups_whole_and_bound_the_padding():
    group = [running(request(10)) for _ in range(4)]
    assert prefill_buckets(group) == [group]  # one prompt, n times: nothing to pad
    mixed = [running(request(n)) for n in (4, 5, 6, 400, 7)]
    buckets = prefill_buckets(mixed)
    assert sorted(len(s.request.input_ids) for b in buckets for s in b) == [4, 5, 6, 7, 400]
    for bucket in buckets:
        lengths = [len(s.request.input_ids) for s in bucket]
        assert len(bucket) * max(lengths) <= PREFILL_PADDING * sum(lengths)


class Letters:
    """A tokenizer whose token t is the letter chr(96 + t) (1 -> 'a')."""

    eos_token_id = 0

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(96 + t) for t in ids if t)


def test_stop_conditions_eos_stop_tokens_stop_strings_and_length():
    stops = StopConditions(Letters(), {0})
    cases = [
        (request(max_new_tokens=8), [1, 0], {"type": "stop", "matched": 0}),
        (request(max_new_tokens=8, ignore_eos=True), [0, 0, 0], None),
        (request(max_new_tokens=8, stop_token_ids=[5]), [1, 5], {"type": "stop", "matched": 5}),
        (request(max_new_tokens=8, stop=["cd"]), [1, 2, 3, 4, 5], {"type": "stop", "matched": "cd"}),
        (request(max_new_tokens=3), [1, 2, 3], {"type": "length", "length": 3}),
    ]
    for req, tokens, finish in cases:
        seq = running(req)
        for token in tokens:
            if seq.finish_reason is not None:
                break
            seq.record(RowStep(token))
            stops.check(seq, token)
        assert seq.finish_reason == finish, (req, tokens)
    seq = running(request(max_new_tokens=8, stop=["cd"]))
    for token in (1, 2, 3, 4):
        seq.record(RowStep(token))
        stops.check(seq, token)
    assert seq.text == "ab"  # the answer's text ends before the stop string


def test_a_running_request_records_what_it_captured_and_answers_with_it():
    req = request(max_new_tokens=2, return_sampling_mask=True)
    seq = running(req)
    seq.record(RowStep(3, support=np.array([1, 3], np.int32), log_mu=-0.5))
    seq.record(RowStep(1, support=np.array([1], np.int32), log_mu=0.0))
    seq.finish_reason = {"type": "length", "length": 2}
    c = seq.completion(Letters(), "v7", "sglang", "0.1.0")
    assert c.output_ids == [3, 1] and c.support.to_lists() == [[1, 3], [1]]
    assert c.log_mu.tolist() == [-0.5, 0.0] and c.weight_version == "v7" and c.text == "ca"
    # the sampler record: the settings it sampled with, its semantics and version
    assert c.sampler["engine"] == "support-replay" and c.sampler["semantics"] == "sglang"
    assert c.sampler["version"] == "0.1.0" and c.sampler["top_k"] == req.params.top_k
    assert c.sampler["temperature"] == req.params.temperature and c.sampler["repetition_penalty"] == 1.0
