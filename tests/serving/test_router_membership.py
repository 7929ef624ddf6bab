"""A router whose engines leave and rejoin (ray-run's): a broadcast that cannot reach an engine counts it as left,
a rejoining engine gets the last weight load replayed and must answer the version the others hold."""

import asyncio

import httpx
from fastapi import FastAPI, Request

from support_replay.serving.router import Router, create_router_app
from support_replay.serving.router_membership import Membership, RejoinError
from support_replay.serving.threaded import ThreadedServer


def fake_engine(calls: list, refuse_version: bool = False) -> ThreadedServer:
    """An engine that records its admin calls and answers the version it was last given (or another one)."""
    app, state = FastAPI(), {"version": "default"}

    @app.post("/update_weights_from_disk")
    async def load(request: Request):
        body = await request.json()
        calls.append(("load", body["model_path"], body["weight_version"]))
        state["version"] = body["weight_version"]
        return {"success": True, "weight_version": body["weight_version"]}

    @app.post("/update_weight_version")
    async def rename(request: Request):
        state["version"] = (await request.json())["new_version"]
        calls.append(("rename", state["version"]))
        return {"success": True, "weight_version": state["version"]}

    @app.post("/pause_generation")
    async def pause():
        calls.append(("pause",))
        return {"success": True}

    @app.get("/model_info")
    async def info():
        return {"weight_version": "stale" if refuse_version else state["version"]}

    @app.get("/health")
    async def health():
        return {}

    return ThreadedServer(app).start()


def test_an_engine_that_left_rejoins_with_the_last_load_and_the_same_version():
    calls_a, calls_b, calls_c, calls_d = [], [], [], []
    a, b = fake_engine(calls_a), fake_engine(calls_b)
    router = Router([a.url, b.url], health_interval=60, membership=Membership())
    server = ThreadedServer(create_router_app(router), lifespan="on").start()
    try:

        def post(path, body):
            return httpx.post(server.url + path, json=body, timeout=10)

        assert post("/update_weights_from_disk", {"model_path": "/w/1", "weight_version": "1"}).status_code == 200
        b.stop()  # b dies: the next broadcast cannot reach it, so it has left, and the push still succeeds
        reply = post("/update_weights_from_disk", {"model_path": "/w/2", "weight_version": "2"})
        assert reply.status_code == 200 and reply.json()["left"] == [b.url], reply.text
        assert post("/update_weight_version", {"new_version": "2b"}).status_code == 200
        assert post("/pause_generation", {"mode": "abort"}).status_code == 200  # of the moment: not replayed
        assert [w["url"] for w in httpx.get(server.url + "/workers").json() if w.get("left")] == [b.url]
        c = fake_engine(calls_c)  # b's next life, on another address
        version = asyncio.run_coroutine_threadsafe(router.rejoin(c.url, replacing=b.url), router.loop).result(10)
        assert version == "2b" and calls_c == [("load", "/w/2", "2"), ("rename", "2b")]  # only the last load
        assert sorted(w.url for w in router.workers) == sorted([a.url, c.url]) and not router.membership.left
        d = fake_engine(calls_d, refuse_version=True)  # an engine that ends at another version is not admitted
        try:
            asyncio.run_coroutine_threadsafe(router.rejoin(d.url), router.loop).result(10)
            raise AssertionError("admitted")
        except RejoinError as exc:
            assert "the others hold '2b'" in str(exc)
        assert d.url not in [w.url for w in router.workers]
    finally:
        server.stop()
        a.stop()


def test_vllm_s_state_routes_are_broadcast_and_replayed_to_a_rejoining_vllm_server(vllm_server):
    """The real vLLM server behind the router: the trainer's weight sync for vLLM (pause, reload_weights through the
    dev-mode /collective_rpc, the version, resume) broadcast; the server, dropped and rejoining, gets the reload and
    the version replayed and is admitted at the version /weight_info answers."""
    from support_replay.backends.vllm_weights import post_dev

    url, checkpoint = vllm_server
    router = Router([url], health_interval=60, membership=Membership())
    server = ThreadedServer(create_router_app(router), lifespan="on").start()
    try:
        post_dev(server.url, "/pause", "pausing generation", params={"mode": "wait"})
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(checkpoint)}}  # its own weights again
        post_dev(server.url, "/collective_rpc", "reloading the weights", json=reload)
        post_dev(server.url, "/update_weight_version", "naming the weights", json={"new_version": "router-7"})
        post_dev(server.url, "/resume", "resuming generation")
        assert [c.path for c in router.membership.calls] == ["/collective_rpc", "/update_weight_version"]
        assert router.membership.version == "router-7"
        router.loop.call_soon_threadsafe(router.drop, url)
        version = asyncio.run_coroutine_threadsafe(router.rejoin(url), router.loop).result(120)
        assert version == "router-7" and [w.url for w in router.workers] == [url]
        body = {"token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2, "top_k": 5}, "output_mode": "tokens"}
        reply = httpx.post(server.url + "/inference/v1/generate", json=body, timeout=60)
        assert reply.status_code == 200 and len(reply.json()["choices"][0]["token_ids"]) == 2, reply.text
    finally:
        server.stop()
