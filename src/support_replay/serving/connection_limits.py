"""How long a client may take to send a request, and how many connections the servers hold
(``connections.py`` applies them; the command line's flags set them)."""

from __future__ import annotations

import resource
from dataclasses import dataclass

FD_RESERVE = 256  # descriptors kept for what the process opens itself (weights, sockets to engines, logs)


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = 10.0  # from a connection (or a request's first byte) to the end of its headers: 408
    body_timeout: float = 60.0  # from the end of the headers to the end of the body: the connection is closed
    max_connections: int = 4096  # held at once (and at most the descriptors the process may open, less a reserve)
    max_connections_per_client: int = 1024  # from one address: one client cannot hold all of them

    def __post_init__(self):
        for name in ("header_timeout", "body_timeout", "max_connections", "max_connections_per_client"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: must be a number > 0, got {value!r}")

    def connections_allowed(self) -> int:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY:
            return self.max_connections
        return max(1, min(self.max_connections, soft - FD_RESERVE))
