"""The engine's slot cache: rows join and leave by copying their own slot, decode writes in place,
and a request's answer does not depend on who joined or left around it."""

import numpy as np
import pytest
import torch

from support_replay import SamplingParams
from support_replay.engine import Engine
from support_replay.engine.slot_cache import SlotCache
from support_replay.protocol import GenerateRequest

pytestmark = pytest.mark.float_bits  # bit-level facts of this CPU's kernels: CI reruns them on AVX2 kernels


def filled(lengths, heads=2, dim=3, layers=2):
    """A cache whose row i holds value 100 * i + column at every held position."""
    cache = SlotCache(layers)
    width = max(lengths)
    keys = torch.zeros(len(lengths), heads, width, dim)
    for i, n in enumerate(lengths):
        keys[i, :, width - n :] = (100 * i + torch.arange(n, dtype=torch.float32))[None, :, None]
    cache.append([(keys, -keys)] * layers, list(lengths))
    return cache


def test_leaving_rows_are_replaced_by_the_last_row_and_only_that_row_moves():
    cache = filled([3, 5, 2, 4, 6])
    order = cache.keep([0, 2, 4])  # rows 1 and 3 leave: slot 1 takes row 4, slot 3 empties
    assert order == [0, 4, 2] and cache.size == 3 and cache.lengths.tolist() == [3, 6, 2]
    for layer in cache.layers:
        for slot, row in enumerate(order):
            n = int(cache.lengths[slot])
            assert torch.equal(layer.k[slot, 0, :n, 0], 100 * row + torch.arange(n, dtype=torch.float32))
            assert torch.equal(layer.v[slot, 0, :n, 0], -(100 * row + torch.arange(n, dtype=torch.float32)))
    assert cache.keep([]) == [] and cache.size == 0


def test_decode_writes_each_rows_column_and_grows_by_doubling():
    cache = filled([2, 4])
    capacity, slots = cache.capacity, cache.slots
    mask = cache.prepare_decode()
    assert mask[:, 0, 0].tolist() == [[True, True, True, False, False], [True] * 5]  # width 5: row 0 sees positions 0-2
    new = torch.full((2, 2, 1, 3), 7.0)
    keys, _ = cache.layers[0].update(new, new)
    assert keys.shape == (2, 2, 5, 3) and keys[0, 0, 2, 0] == 7 and keys[1, 0, 4, 0] == 7 and keys[1, 0, 3, 0] == 103
    cache.finish_decode()
    for _ in range(capacity):
        cache.prepare_decode()
        cache.finish_decode()
    assert cache.capacity == 2 * capacity >= int(cache.lengths.max())  # doubled once
    assert cache.slots == slots  # longer rows do not double the slots
    assert cache.layers[0].k[1, 0, 3, 0] == 103 and cache.layers[0].k[0, 0, 2, 0] == 7  # kept across the regrowth


def test_requests_joining_and_leaving_mid_flight_answer_as_alone(tiny_checkpoint):
    """Deterministic engine, driven step by step: three requests start, two more join after three
    decode steps, all with different lengths so they leave at different steps (each leaving slot
    taken by the last row); every answer equals the same request alone, bit for bit."""
    engine = Engine.from_pretrained(tiny_checkpoint, deterministic=True)
    reqs = [
        GenerateRequest(
            [5 + i, 6, 7, 8][: 2 + i % 3],
            SamplingParams(top_k=20, top_p=0.9, seed=i),
            max_new_tokens=3 + 2 * i,
            ignore_eos=True,
            return_sampling_mask=True,
        )
        for i in range(5)
    ]
    first = [engine.submit(r) for r in reqs[:3]]
    for _ in range(4):
        engine.step()
    late = [engine.submit(r) for r in reqs[3:]]
    while not all(f.done() for f in first + late):
        engine.step()
    together = [f.result() for f in first + late]
    for req, got in zip(reqs, together):
        alone = engine.generate([req])[0]
        assert (
            got.output_ids == alone.output_ids
            and np.array_equal(got.log_mu, alone.log_mu)
            and got.support == alone.support
        )
    engine.shutdown()
