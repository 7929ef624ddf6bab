"""Every support id's log q over HTTP: our serve's binary form (float32, ascending ids) and SGLang's lists,
read by the SGLang backend as the in-process engine computed them."""

from __future__ import annotations

import numpy as np
import pytest

from support_replay import SamplingParams
from support_replay.backends.local import EngineBackend
from support_replay.backends.sglang import SGLangBackend
from support_replay.engine import Engine, EngineSettings
from support_replay.protocol import GenerateRequest
from support_replay.serving.server import create_app
from support_replay.serving.threaded import ThreadedServer


@pytest.fixture(scope="module")
def served(tiny_checkpoint):
    engine = Engine.from_pretrained(tiny_checkpoint, EngineSettings(deterministic=True, linear_kernel="torch"))
    server = ThreadedServer(create_app(engine)).start()
    yield engine, server.url
    server.stop()
    engine.shutdown()


def requests():
    return [
        GenerateRequest([5, 6, 7 + i], SamplingParams(temperature=0.9, top_p=0.9, top_k=20, seed=i), max_new_tokens=6,
                        return_sampling_mask=True, sampling_logprobs_mode="support")
        for i in range(3)
    ]  # fmt: skip


@pytest.mark.parametrize("form", ["binary", "lists"])
def test_log_q_of_every_support_id_crosses_the_wire_exactly(served, form):
    engine, url = served
    local = EngineBackend(engine).generate(requests())
    backend = SGLangBackend(url, engine.vocab_size, sampling_mask_format=form)
    remote = backend.generate(requests())
    for a, b in zip(local, remote):
        assert a.output_ids == b.output_ids
        assert all(np.array_equal(x, y) for x, y in zip(a.support_row_logprobs, b.support_row_logprobs))
    sizes = sum(int(c.support.sizes().sum()) for c in remote)
    binary = [c.support_bytes for c in remote]
    assert all(b > 0 for b in binary) and sizes > 0
