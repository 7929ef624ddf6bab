"""A router over engines that forwards raw request bodies.

Bytes in, bytes out: fields the router knows nothing about (``return_sampling_mask``,
``sampling_logprobs_mode``, ``rid``, ...) reach the engine untouched, and the engine's response
comes back as it was sent. Requests go to the healthy engine with the fewest outstanding
requests; an engine that fails before answering (connection refused or dropped) is marked down
and the request is retried on another one with the same body, so the same ``rid`` and seed (an
engine answers a repeated ``rid`` once); one that gives no answer within the request timeout
answers 504 and is not retried (it may still be computing it). A client that goes away cancels
the forwarded request. Requests of a session (header ``X-Session-Id``) all go to the engine its first turn
went to and are not
retried elsewhere: the session's context, and its prefix cache, live there. Weight
updates, version changes and cache flushes are broadcast to every engine, with the admin key (SGLang's routes, and
vLLM's pause, reload and resume for vLLM servers behind it).
Health is checked periodically. The body limit, the JSON-only rule and the Host check are the
engine server's (``security.py``); ``/metrics`` counts answers, retries and unserved requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from ..protocol import SESSION_HEADER
from . import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_ROUTER_PORT, NO_TELEMETRY
from .connection_limits import ConnectionLimits
from .disconnects import unless_disconnected
from .metrics import render_router_metrics
from .router_membership import Membership, StateCall, json_or_text
from .security import ADMIN_PATHS, DEFAULT_MAX_WEIGHTS_BYTES, VLLM_ADMIN_PATHS, WEIGHTS_OVER_HTTP, Keys, guarded

log = logging.getLogger(__name__)

BROADCAST_PATHS = ADMIN_PATHS + VLLM_ADMIN_PATHS  # every route that changes an engine's state reaches every engine
OPEN_PATHS = ("/health", "/metrics")
DEFAULT_REQUEST_TIMEOUT = 600.0  # seconds for one engine to answer one request
_FORWARD_HEADERS = ("content-type", "accept", SESSION_HEADER.lower())
MAX_SESSIONS = 100_000  # session -> engine entries kept, least recently used dropped first
# failures before an answer that leave the request unserved by that engine: tried on another one
_RETRYABLE = (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)
# no answer within the timeout: the engine may still be computing it, so it is not sent to every other engine in turn
_TIMED_OUT = (httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout)


@dataclass
class Worker:
    url: str
    healthy: bool = True
    outstanding: int = 0
    served: int = 0
    failures: int = 0


class Router:
    def __init__(
        self,
        engine_urls: list[str],
        health_interval: float = 5.0,
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        keys: Keys | None = None,
        upstream: Keys | None = None,
        membership: Membership | None = None,
    ):
        if not engine_urls:
            raise ValueError("router: at least one --engine URL is needed")
        self.workers = [Worker(u.rstrip("/")) for u in engine_urls]
        self.health_interval = health_interval
        self.timeout = httpx.Timeout(request_timeout, connect=5.0)
        self.keys = keys or Keys()  # checked on the way in
        self.upstream = upstream or Keys()  # sent to the engines (Keys.load_upstream): never the clients' key
        self.client: httpx.AsyncClient | None = None
        self.answered: dict[tuple[str, int], int] = {}
        self.retries = 0
        self.unserved = 0
        self.affinity: OrderedDict[str, Worker] = OrderedDict()  # session id -> its engine, most recent last
        # engines that leave and rejoin (ray-run): a broadcast that cannot reach one drops it; rejoin() brings it back
        self.membership = membership
        self.loop: asyncio.AbstractEventLoop | None = None  # the server's loop (for calls from another thread)

    def session_worker(self, session: str) -> Worker | None:
        """The engine of a session: chosen on its first turn, kept for every later one."""
        worker = self.affinity.get(session)
        if worker is None:
            worker = self.pick(set())
            if worker is None:
                return None
            self.affinity[session] = worker
            if len(self.affinity) > MAX_SESSIONS:
                self.affinity.popitem(last=False)
        self.affinity.move_to_end(session)
        return worker

    def pick(self, exclude: set[str]) -> Worker | None:
        candidates = [w for w in self.workers if w.healthy and w.url not in exclude]
        if not candidates:  # everyone looks down: try the ones not yet tried anyway
            candidates = [w for w in self.workers if w.url not in exclude]
        return min(candidates, key=lambda w: (w.outstanding, w.served)) if candidates else None

    async def forward(self, method: str, path: str, body: bytes, headers: dict) -> Response:
        session = headers.get(SESSION_HEADER.lower())
        if session:
            return await self.forward_session(session, method, path, body, headers)
        tried: set[str] = set()
        last_error = "no engine configured"
        while (worker := self.pick(tried)) is not None:
            if tried:
                self.retries += 1
            tried.add(worker.url)
            worker.outstanding += 1
            try:
                reply = await self._send(worker, method, path, body, headers)
            except _RETRYABLE as exc:
                worker.healthy, worker.failures = False, worker.failures + 1
                last_error = f"{worker.url}: {type(exc).__name__}: {exc}"
                log.warning("engine failed before answering, retrying elsewhere: %s", last_error)
                continue
            except _TIMED_OUT as exc:
                self.unserved += 1
                timeout = f"{worker.url} gave no answer within the request timeout ({type(exc).__name__})"
                return _error(f"{timeout}; not retried elsewhere: it may still be running it", 504)
            finally:
                worker.outstanding -= 1
            self._count(worker, reply)
            headers_out = {"Retry-After": reply.headers["retry-after"]} if "retry-after" in reply.headers else None
            return await relayed(reply, headers_out)
        self.unserved += 1
        return JSONResponse(
            {"error": {"message": f"no engine could serve the request ({last_error})", "code": 503}},
            status_code=503,
            headers={"Retry-After": "1"},
        )

    async def forward_session(self, session: str, method: str, path: str, body: bytes, headers: dict) -> Response:
        """Every turn of a session to its engine (its prefix cache stays warm); never elsewhere:
        the session's context lives there, so a failed engine fails the turn (502)."""
        worker = self.session_worker(session)
        if worker is None:
            self.unserved += 1
            return _error("no engine configured", 503)
        worker.outstanding += 1
        try:
            reply = await self._send(worker, method, path, body, headers)
        except (*_RETRYABLE, *_TIMED_OUT) as exc:
            worker.healthy, worker.failures = False, worker.failures + 1
            self.unserved += 1
            failed = f"session {session[:80]}: its engine {worker.url} failed ({type(exc).__name__})"
            return _error(f"{failed}; a session's turns are not moved to another engine", 502)
        finally:
            worker.outstanding -= 1
        self._count(worker, reply)
        return await relayed(reply)

    async def _send(self, worker: Worker, method: str, path: str, body: bytes, headers: dict) -> httpx.Response:
        """The request, raw body and headers as they came, with the router's own key for the engine; the
        answer's body still to read (``relayed``), so a stream can pass through as it comes."""
        auth = {**headers, **self.upstream.header(admin=False)}
        request = self.client.build_request(method, worker.url + path, content=body, headers=auth)
        return await self.client.send(request, stream=True)

    def _count(self, worker: Worker, reply: httpx.Response) -> None:
        worker.served += 1
        key = (worker.url, reply.status_code)
        self.answered[key] = self.answered.get(key, 0) + 1

    async def broadcast(self, method: str, path: str, body: bytes, headers: dict) -> Response:
        if self.membership is None:
            return await self._broadcast(method, path, body, headers)
        async with self.membership.lock:  # never beside a rejoin: the rejoining engine gets this call or its replay
            return await self._broadcast(method, path, body, headers)

    async def _broadcast(self, method: str, path: str, body: bytes, headers: dict) -> Response:
        async def one(w: Worker):
            try:
                r = await self.client.request(
                    method, w.url + path, content=body, headers={**headers, **self.upstream.header(admin=True)}
                )
                return {"engine": w.url, "status": r.status_code, "body": json_or_text(r)}
            except httpx.HTTPError as exc:
                w.healthy = False
                # nothing listening, or the connection dropped: not running (a timeout is an engine still busy)
                left = self.membership is not None and isinstance(exc, _RETRYABLE)
                return {"engine": w.url, "status": None if left else 503, "body": f"{type(exc).__name__}: {exc}"}

        results = await asyncio.gather(*(one(w) for w in self.workers))
        left = [r["engine"] for r in results if r["status"] is None]  # not running: they rejoin with this call
        for url in left:
            self.drop(url)
        results = [r for r in results if r["status"] is not None]
        ok = bool(results) and all(r["status"] == 200 for r in results)
        if ok and self.membership is not None:
            call = StateCall(method, path.split("?", 1)[0], path, body, headers)
            self.membership.record(call, [r["body"] for r in results])
        answer = {"success": ok, "engines": results, **({"left": left} if left else {})}
        return JSONResponse(answer, status_code=200 if ok else 502)

    def drop(self, url: str) -> None:
        """``url`` out of rotation until it rejoins (its requests in flight fail over, as for any failure)."""
        self.workers = [w for w in self.workers if w.url != url]
        self.affinity = OrderedDict((s, w) for s, w in self.affinity.items() if w.url != url)
        self.membership.left.add(url)

    async def rejoin(self, url: str, replacing: str | None = None) -> str | None:
        """The engine at ``url`` (in place of ``replacing``, its earlier address) into rotation once it holds the
        others' state (router_membership.py); returns its weight_version."""
        url = url.rstrip("/")
        async with self.membership.lock:
            if replacing is not None and any(w.url == replacing for w in self.workers):
                self.drop(replacing)
            version = await self.membership.replay(self.client, url, self.upstream.header(admin=True))
            self.workers = [*(w for w in self.workers if w.url != url), Worker(url)]
            self.membership.left -= {url, replacing}
            self.membership.rejoined += 1
            return version

    async def check_health(self) -> None:
        async def one(w: Worker):
            try:
                r = await self.client.get(w.url + "/health", timeout=2.0)
                w.healthy = r.status_code == 200
            except httpx.HTTPError:
                w.healthy = False

        await asyncio.gather(*(one(w) for w in self.workers))

    async def health_loop(self) -> None:
        while True:
            await asyncio.sleep(self.health_interval)
            await self.check_health()


async def relayed(reply: httpx.Response, headers: dict | None = None) -> Response:
    """The engine's answer to the client: an event stream chunk by chunk as the engine sends it (closing
    it when the client goes away, which aborts the request there), anything else once read whole."""
    media = reply.headers.get("content-type")
    if media and media.startswith("text/event-stream"):

        async def chunks():
            try:
                async for chunk in reply.aiter_raw():
                    yield chunk
            finally:
                await reply.aclose()

        return StreamingResponse(chunks(), status_code=reply.status_code, media_type=media, headers=headers)
    try:
        content = await reply.aread()
    finally:
        await reply.aclose()
    return Response(content, status_code=reply.status_code, media_type=media, headers=headers)


def _error(message: str, code: int) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "code": code}}, status_code=code)


def cancelled(task) -> Response:
    task.cancel()
    return None


def create_router_app(
    router: Router, *, max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, allowed_hosts: list[str] | None = None
):
    @asynccontextmanager
    async def lifespan(_app):
        router.client = httpx.AsyncClient(
            timeout=router.timeout, limits=httpx.Limits(max_connections=None, max_keepalive_connections=64)
        )
        router.loop = asyncio.get_running_loop()
        await router.check_health()
        task = asyncio.create_task(router.health_loop())
        try:
            yield
        finally:
            task.cancel()
            await router.client.aclose()

    app = FastAPI(title="support-replay router", lifespan=lifespan, telemetry=NO_TELEMETRY)

    @app.get("/metrics")
    async def metrics():
        return Response(render_router_metrics(router), media_type=CONTENT_TYPE_LATEST)

    @app.get("/health")
    async def health():
        healthy = [w.url for w in router.workers if w.healthy]
        return JSONResponse(
            {"status": "ok" if healthy else "no healthy engine", "healthy": healthy},
            status_code=200 if healthy else 503,
        )

    @app.get("/workers")
    async def workers():
        return [vars(w) for w in router.workers] + [
            {"url": url, "left": True} for url in sorted(router.membership.left if router.membership else ())
        ]

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def proxy(path: str, request: Request):
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() in _FORWARD_HEADERS}
        # the path in normal form (security.NormalPaths: no '?', '#' or '%' once decoded), so the engine gets the path
        # the guards checked: httpx cannot read a query or a fragment out of it
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        if "/" + path in BROADCAST_PATHS:
            return await router.broadcast(request.method, target, body, headers)
        # a client going away cancels the forwarded request: its connection to the engine closes, and the engine drops
        # it
        return await unless_disconnected(router.forward(request.method, target, body, headers), request, cancelled)

    return guarded(
        app,
        router.keys,
        BROADCAST_PATHS,
        OPEN_PATHS,
        allowed_hosts=allowed_hosts,
        max_request_bytes=max_request_bytes,
        binary_paths={WEIGHTS_OVER_HTTP: DEFAULT_MAX_WEIGHTS_BYTES},
    )


def run_router(
    engine_urls: list[str],
    host: str = "127.0.0.1",
    port: int = DEFAULT_ROUTER_PORT,
    health_interval: float = 5.0,
    *,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    keys: Keys | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    allowed_hosts: list[str] | None = None,
    connections: ConnectionLimits | None = None,
    upstream: Keys | None = None,
) -> None:
    import uvicorn

    from .connections import uvicorn_config
    from .server import allowed_hosts_for, announce_exposure

    announce_exposure(host, keys or Keys())
    router = Router(engine_urls, health_interval, request_timeout, keys, upstream)
    app = create_router_app(
        router, max_request_bytes=max_request_bytes, allowed_hosts=allowed_hosts_for(host, allowed_hosts)
    )
    uvicorn.Server(uvicorn_config(app, host, port, connections)).run()
