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
