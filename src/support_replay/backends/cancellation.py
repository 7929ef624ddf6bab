"""A turn's client went away: the request it waits on is dropped at the engine.

A ``threading.Event`` the serving side sets, with callbacks a backend registers while its request is in flight:
setting it closes the request's socket, so the engine sees its client leave and aborts the request even while
it waits in the queue or prefills (a flag read between streamed chunks was read only once a token came)."""

from __future__ import annotations

import socket
import threading


class Cancellation(threading.Event):
    def __init__(self):
        super().__init__()
        self._callbacks: list = []
        self._lock = threading.Lock()

    def on_set(self, callback) -> None:
        """Call ``callback`` when the event is set (at once if it is)."""
        with self._lock:
            if not self.is_set():
                self._callbacks.append(callback)
                return
        callback()

    def set(self) -> None:
        with self._lock:
            super().set()
            callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            try:
                callback()
            except OSError:
                pass  # the connection closed meanwhile


def close_socket_of(reply) -> None:
    """Shut the socket of an httpx streamed ``reply`` down (interrupting a thread blocked reading it)."""
    stream = reply.extensions.get("network_stream")
    sock = stream.get_extra_info("socket") if stream is not None else None
    if sock is not None:
        sock.shutdown(socket.SHUT_RDWR)
