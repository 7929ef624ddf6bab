"""The real native router (PyPI sglang-router) in front of our engine (docs/engines.md)."""

import sys

import httpx
import pytest

from processes import engine_process, free_port, process, router_process, wait_healthy
from support_replay import SamplingParams, WireError
from support_replay.backends import SGLangBackend
from support_replay.protocol import GenerateRequest

pytestmark = pytest.mark.slow


def sglang_router(worker_url: str):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        worker_url,
        "--log-level",
        "warn",
    ]
    return process(args, url, health=False), url


@pytest.mark.processes
def test_capture_survives_our_router_and_fails_closed_through_sglang_router(tiny_checkpoint):
    pytest.importorskip("sglang_router")
    ctx, engine_url = engine_process(tiny_checkpoint)
    with ctx:
        vocab = httpx.get(engine_url + "/model_info").json()["vocab_size"]
        request = GenerateRequest(
            [5, 6, 7], SamplingParams(top_k=8, top_p=0.9, seed=1), max_new_tokens=4, return_sampling_mask=True
        )
        ours, ours_url = router_process([engine_url])
        with ours:
            (c,) = SGLangBackend(ours_url, vocab).generate([request])
            assert c.support.num_rows == 4
        native, native_url = sglang_router(engine_url)
        with native:
            wait_healthy(native_url, timeout=60)
            with pytest.raises(WireError, match="return_sampling_mask.*router on the path .* may have stripped it"):
                SGLangBackend(native_url, vocab).generate([request])
            # what the router does to the body: the response comes back without any capture field
            r = httpx.post(
                native_url + "/generate",
                json={"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}, "return_sampling_mask": True},
            )
            assert r.status_code == 200 and "output_token_sampling_mask" not in r.json()["meta_info"]
            # evaluation requests (no capture) still work through it
            evaluation = GenerateRequest([5, 6, 7], SamplingParams(top_k=8, seed=1), max_new_tokens=3)
            assert len(SGLangBackend(native_url, vocab).generate([evaluation])[0].output_ids) == 3
