"""An ASGI app served by uvicorn on a thread of this process (the trainer's session endpoint;
``serve``, whose main thread runs the engine)."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from .connection_limits import ConnectionLimits
from .connections import uvicorn_config


class ThreadedServer:
    def __init__(
        self,
        app,
        host: str = "127.0.0.1",
        port: int = 0,
        lifespan: str = "off",
        connections: ConnectionLimits | None = None,
    ):
        if port == 0:  # a free port now; the OS will not hand it out again while we bind it next
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.url = f"http://{host}:{port}"
        self.server = uvicorn.Server(uvicorn_config(app, host, port, connections, lifespan=lifespan))
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{port}", daemon=True)

    def start(self, timeout: float = 30.0) -> ThreadedServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server at {self.url} did not start (the port taken? uvicorn's log above says)")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
