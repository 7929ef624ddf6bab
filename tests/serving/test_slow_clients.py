"""Issue 55, finding 7: no server bounded how long a client may take to send its request, or how many
connections it may hold: half a request's headers, or its headers and 12 bytes of an 8 MB body, kept a
connection open for good. Probed with raw sockets against a real uvicorn, as the review did."""

import socket
import sys
import time

import httpx
import pytest
from fastapi import FastAPI, Request

from support_replay.serving.connection_limits import ConnectionLimits
from support_replay.serving.threaded import ThreadedServer

QUICK = ConnectionLimits(header_timeout=0.5, body_timeout=0.5, max_connections=64, max_connections_per_client=8)


def echo_app() -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health():
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request):
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture
def server():
    served = ThreadedServer(echo_app(), connections=QUICK).start()
    yield served
    served.stop()


def connect(url: str, source: str = "127.0.0.1") -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=5, source_address=(source, 0))


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (a socket timeout here fails the test: it stayed open)."""
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def test_half_the_headers_get_a_408_and_the_connection_closes(server):
    sock = connect(server.url)
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and nothing more
    reply = read_until_closed(sock)  # before: still open after 30 s
    assert reply.startswith(b"HTTP/1.1 408") and b"headers did not arrive" in reply


def test_a_connection_that_sends_nothing_is_closed(server):
    assert read_until_closed(connect(server.url)).startswith(b"HTTP/1.1 408")


def test_a_body_that_stops_short_closes_the_connection(server):
    sock = connect(server.url)
    head = b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 8388608\r\n\r\n"
    sock.sendall(head + b'{"prompt": "')  # 12 bytes of 8 MB
    assert read_until_closed(sock) == b""  # closed; the handler saw its client leave


def test_slow_headers_after_a_kept_alive_request_are_cut_off_too(server):
    sock = connect(server.url)
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    first = b""
    while not first.endswith(b'{"ok":true}'):
        first += sock.recv(65536)
    assert first.startswith(b"HTTP/1.1 200")
    sock.sendall(b"GET /health HTTP/1.1\r\n")  # the next request's first line, then silence
    assert read_until_closed(sock).startswith(b"HTTP/1.1 408")


def test_a_request_sent_in_time_is_served_whole(server):
    sock = connect(server.url)
    body = b"x" * 100_000
    sock.sendall(b"POST /echo HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100000\r\nConnection: close\r\n\r\n")
    for i in range(0, len(body), 25_000):  # slow, but within the body's deadline
        sock.sendall(body[i : i + 25_000])
        time.sleep(0.05)
    reply = read_until_closed(sock)
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b'{"bytes":100000}')


def test_one_address_holds_at_most_its_share_and_others_are_still_served(server):
    held = [connect(server.url) for _ in range(QUICK.max_connections_per_client)]
    try:
        refused = connect(server.url)
        assert read_until_closed(refused).startswith(b"HTTP/1.1 503")
        # another address (127.0.0.2, still loopback) is served meanwhile
        host, port = server.url.removeprefix("http://").split(":")
        with httpx.Client(transport=httpx.HTTPTransport(local_address="127.0.0.2")) as other:
            assert other.get(f"http://{host}:{port}/health").status_code == 200
    finally:
        for sock in held:
            sock.close()


def test_past_max_connections_a_new_connection_gets_a_503():
    limits = ConnectionLimits(header_timeout=5, body_timeout=5, max_connections=4, max_connections_per_client=4)
    served = ThreadedServer(echo_app(), connections=limits).start()
    try:
        held = [connect(served.url, f"127.0.0.{i + 2}") for i in range(4)]
        assert read_until_closed(connect(served.url, "127.0.0.9")).startswith(b"HTTP/1.1 503")
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 10
        while True:  # the server sees them go
            with connect(served.url, "127.0.0.9") as sock:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                if read_until_closed(sock).startswith(b"HTTP/1.1 200") or time.monotonic() > deadline:
                    break
        assert httpx.get(served.url + "/health").status_code == 200
    finally:
        served.stop()


def listening(url: str, timeout: float = 120.0) -> None:
    """Wait until ``url``'s port accepts connections (the servers start at once, not one after another)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            connect(url).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.mark.processes
def test_serve_router_and_sessions_cut_off_slow_headers(tiny_checkpoint):
    """The three server commands take the flags and apply them (a real process each, as the review probed)."""
    from contextlib import ExitStack

    from processes import free_port, process

    quick = ["--header-timeout", "0.5", "--body-timeout", "0.5"]
    ports = [free_port() for _ in range(3)]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    commands = [
        ["serve", "--hf-checkpoint", str(tiny_checkpoint)],
        ["router", "--engine", urls[0]],
        ["sessions", "--backend", urls[0], "--tokenizer", str(tiny_checkpoint)],
    ]
    with ExitStack() as stack:
        for command, port, url in zip(commands, ports, urls):
            args = [sys.executable, "-m", "support_replay.cli", *command, "--port", str(port), *quick]
            stack.enter_context(process(args, url, health=False))  # started together
        for url in urls:
            listening(url)
            sock = connect(url)
            sock.sendall(b"POST /generate HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 8388608\r\n")
            assert read_until_closed(sock).startswith(b"HTTP/1.1 408"), url
