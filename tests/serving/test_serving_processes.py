"""Server and router as real processes on loopback: concurrency, pass-through, failover."""

import json
import signal
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from processes import engine_process, engine_processes, free_port, router_process
from support_replay import support_logprobs
from support_replay.backends.sglang import parse_meta_info

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def reference_model(tiny_checkpoint):
    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()


def ask(url, ids, seed, max_new_tokens=12, **extra):
    body = {
        "input_ids": ids,
        "sampling_params": {
            "temperature": 1.0,
            "top_k": 32,
            "top_p": 0.85,
            "max_new_tokens": max_new_tokens,
            "seed": seed,
        },
        "return_sampling_mask": True,
        **extra,
    }
    r = httpx.post(url + "/generate", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.processes
def test_concurrent_requests_through_the_router(tiny_checkpoint, reference_model):
    with engine_processes(tiny_checkpoint, 2) as [(_, url_a), (_, url_b)]:
        ctx, router_url = router_process([url_a, url_b])
        with ctx:
            prompts = [[5 + i, 40 + i, 77, 120 + 3 * i] for i in range(16)]
            with ThreadPoolExecutor(16) as pool:
                outs = list(pool.map(lambda i: ask(router_url, prompts[i], seed=i), range(16)))
            vocab = reference_model.config.vocab_size
            for ids, out in zip(prompts, outs):
                table, logmu, *_ = parse_meta_info(out["meta_info"], out["output_ids"], vocab)
                full = torch.tensor([ids + out["output_ids"]])
                with torch.no_grad():
                    logits = reference_model(full).logits[0, len(ids) - 1 : -1].float()
                again = support_logprobs(logits, torch.tensor(out["output_ids"]), table, 1.0)
                torch.testing.assert_close(again, torch.from_numpy(logmu), atol=1e-4, rtol=0)
            workers = httpx.get(router_url + "/workers").json()
            assert sum(w["served"] for w in workers) == 16 and all(w["served"] > 0 for w in workers)
            # unknown fields pass through the router untouched: the engine reacts to them
            binary = ask(router_url, prompts[0], seed=0, sampling_mask_format="binary")
            assert isinstance(binary["meta_info"]["output_token_sampling_mask"], str)
            # weight updates are broadcast to every engine
            r = httpx.post(
                router_url + "/update_weights_from_disk", json={"model_path": str(tiny_checkpoint)}, timeout=60
            )
            assert r.status_code == 200 and r.json()["success"] and len(r.json()["engines"]) == 2
            # so are SGLang's pause, continue and abort_request (a push into running requests, a partial rollout's stop)
            for path, body in (
                ("/pause_generation", {"mode": "retract"}),
                ("/continue_generation", {}),
                ("/abort_request", {"rid": "no-such-request"}),
            ):
                r = httpx.post(router_url + path, json=body, timeout=60)
                assert r.status_code == 200 and [e["status"] for e in r.json()["engines"]] == [200, 200], r.text
            # capacity overflow: 400, and the engine keeps serving
            r = httpx.post(
                router_url + "/generate",
                json={"input_ids": [5, 6], "sampling_params": {"top_k": 5000}, "return_sampling_mask": True},
            )
            assert r.status_code == 400 and "sampling_mask_max_tokens" in r.text
            assert ask(router_url, prompts[1], seed=1)["meta_info"]["completion_tokens"] == 12


@pytest.mark.processes
def test_router_retries_when_an_engine_dies_mid_request(tiny_checkpoint):
    with engine_processes(tiny_checkpoint, 2) as [(proc_a, url_a), (_, url_b)]:
        ctx, router_url = router_process([url_a, url_b], health_interval=30)
        with ctx:
            with ThreadPoolExecutor(1) as pool:
                pending = pool.submit(
                    ask,
                    router_url,
                    [5, 6, 7],
                    3,
                    400,
                    sampling_params={
                        "temperature": 1.0,
                        "top_k": 8,
                        "max_new_tokens": 400,
                        "ignore_eos": True,
                        "seed": 3,
                    },
                )
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:
                    workers = {w["url"]: w for w in httpx.get(router_url + "/workers").json()}
                    if workers[url_a]["outstanding"] == 1:
                        break
                    time.sleep(0.02)
                assert workers[url_a]["outstanding"] == 1, workers
                proc_a.send_signal(signal.SIGKILL)
                out = pending.result(timeout=120)
            assert out["meta_info"]["completion_tokens"] == 400
            assert len(json.loads(json.dumps(out["meta_info"]["output_token_sampling_mask"]))) == 400
            workers = {w["url"]: w for w in httpx.get(router_url + "/workers").json()}
            assert workers[url_a]["failures"] == 1 and workers[url_a]["served"] == 0
            assert workers[url_b]["served"] == 1  # served once, elsewhere: nothing lost or duplicated


@pytest.mark.processes
def test_a_client_that_goes_away_frees_its_slot(tiny_checkpoint):
    ctx, url = engine_process(tiny_checkpoint)
    with ctx:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up on a long request
            httpx.post(
                url + "/generate",
                json={"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}},
                timeout=0.3,
            )
        for _ in range(100):  # the server notices within its poll interval and drops the request
            if httpx.get(url + "/health").json()["running"] == 0:
                break
            time.sleep(0.1)
        assert httpx.get(url + "/health").json()["running"] == 0
        assert 'support_replay_requests_total{status="aborted"} 1.0' in httpx.get(url + "/metrics").text


@pytest.mark.processes
def test_serve_stops_on_sigterm_and_names_a_taken_port(tiny_checkpoint):
    """``serve`` runs the engine on its main thread and uvicorn on another: SIGTERM stops both and
    the process exits 0; a second server on the same port fails with the address named."""
    import subprocess
    import sys

    ctx, url = engine_process(tiny_checkpoint)
    with ctx as proc:
        port = url.rsplit(":", 1)[1]
        second = subprocess.run(
            [
                sys.executable,
                "-m",
                "support_replay.cli",
                "serve",
                "--hf-checkpoint",
                str(tiny_checkpoint),
                "--port",
                port,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode != 0 and f"127.0.0.1:{port}" in second.stderr, second.stderr[-2000:]
        assert httpx.get(url + "/health", timeout=10).status_code == 200  # the first one still serves
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0


def test_serve_stops_when_its_http_thread_dies(tiny_checkpoint, monkeypatch):
    """The engine's loop on the main thread watches uvicorn's thread: if it ends by itself, serve
    returns with a named error instead of stepping forever behind a dead port."""
    import threading

    from support_replay.engine import Engine
    from support_replay.errors import EngineError
    from support_replay.serving import threaded
    from support_replay.serving.server import serve

    real_start = threaded.ThreadedServer.start

    def start(self, timeout=30.0):  # uvicorn told to exit a second after it started, behind serve's back
        real_start(self, timeout)
        threading.Timer(1.0, lambda: setattr(self.server, "should_exit", True)).start()
        return self

    monkeypatch.setattr(threaded.ThreadedServer, "start", start)
    port = free_port()
    with pytest.raises(EngineError, match=f"127.0.0.1:{port} stopped unexpectedly"):
        serve(Engine.from_pretrained(tiny_checkpoint), port=port)
    assert torch.is_grad_enabled()  # the loop ran on this thread and left its autograd mode alone
