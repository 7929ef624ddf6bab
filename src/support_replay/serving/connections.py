"""Slow clients cut off: a deadline on a request's headers and one on its body, and bounds on the connections
held, on every server (``serve``, ``router``, ``sessions``).

uvicorn bounds the idle time between requests (``timeout_keep_alive``) and nothing else: a connection that
sent half its headers, or its headers and 12 bytes of an 8 MB body, stayed open for good (docs/reliability.md,
round three), and enough of them take every file descriptor the process has. Its h11 protocol is extended
here: the state h11 keeps of the client (waiting for headers, sending its body, done) after each read says
which deadline runs."""

from __future__ import annotations

import asyncio

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from .connection_limits import ConnectionLimits


def refusal(status: str, reason: str) -> bytes:
    body = reason.encode()
    return (
        f"HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
        f"retry-after: 1\r\ncontent-length: {len(body)}\r\n\r\n"
    ).encode() + body


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and connection bounds of ``limits`` (set on a subclass)."""

    limits = ConnectionLimits()
    allowed = ConnectionLimits().max_connections
    per_client: dict[str, int]  # connections held by address, shared by a server's connections

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._phase: str | None = None  # "headers" or "body": which deadline runs
        self._counted: str | None = None
        peer = transport.get_extra_info("peername")
        host = peer[0] if isinstance(peer, tuple) else str(peer)
        held = self.per_client.get(host, 0)
        if len(self.server_state.connections) >= self.allowed or held >= self.limits.max_connections_per_client:
            self.transport = transport  # what connection_lost reads
            transport.write(refusal("503 Service Unavailable", "too many connections; retry later"))
            transport.close()
            return
        self.per_client[host], self._counted = held + 1, host
        super().connection_made(transport)
        self._arm(self.limits.header_timeout, b"the request's headers did not arrive in time")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted is not None:
            left = self.per_client.get(self._counted, 1) - 1
            if left > 0:
                self.per_client[self._counted] = left
            else:
                self.per_client.pop(self._counted, None)
            self._counted = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def _follow(self) -> None:
        """Run the deadline of the client's state: its headers while h11 waits for them (a first byte after an
        idle keep-alive arms it; before that, uvicorn's keep-alive timeout runs), its body while it sends one."""
        if self.transport is None or self.transport.is_closing():
            return
        state, phase = self.conn.their_state, self._phase
        if state is h11.IDLE:
            if phase != "headers" and self.conn.trailing_data[0]:
                self._arm(self.limits.header_timeout, b"the request's headers did not arrive in time")
        elif state is h11.SEND_BODY:
            if phase != "body":
                self._arm(self.limits.body_timeout, None)
        else:
            self._disarm()

    def _arm(self, seconds: float, reason: bytes | None) -> None:
        self._disarm()
        self._phase = "headers" if reason is not None else "body"
        self._deadline = self.loop.call_later(seconds, self._expired, reason)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, None

    def _expired(self, reason: bytes | None) -> None:
        """Past a deadline: a 408 while no request is running (headers), else the connection closes (its body;
        the handler sees the client leave)."""
        self._deadline = None
        if self.transport.is_closing():
            return
        if reason is not None and (self.cycle is None or self.cycle.response_complete):
            self.transport.write(refusal("408 Request Timeout", reason.decode()))
        self.transport.close()


def protocol_for(limits: ConnectionLimits) -> type[DeadlineH11Protocol]:
    """A protocol class bound to ``limits`` (uvicorn builds one instance per connection from the class)."""
    return type(
        "DeadlineH11Protocol",
        (DeadlineH11Protocol,),
        {"limits": limits, "allowed": limits.connections_allowed(), "per_client": {}},
    )


def uvicorn_config(app, host: str, port: int, limits: ConnectionLimits | None = None, **kwargs) -> uvicorn.Config:
    """uvicorn's settings for our servers: h11 with the deadlines and bounds of ``limits``."""
    limits = limits or ConnectionLimits()
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="warning",
        http=protocol_for(limits),
        backlog=limits.connections_allowed(),
        **kwargs,
    )
