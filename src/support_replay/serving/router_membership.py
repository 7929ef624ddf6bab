"""Engines that leave a router and rejoin it with the state the others hold (ray-run's supervised engines).

An engine that Ray restarts comes back with the checkpoint it started from, on a new port. Before the router sends
it a request it gets what every other engine got since: the last weight load (from a directory or in the body) and
what followed it (a version renamed, adapters loaded or unloaded), replayed in order; then its ``weight_version``
(``/model_info``; vLLM's ``/weight_info``) must be the one the others answered. An engine that cannot be reached
during a broadcast has left: it is not running, so it holds no state that call could change, and it rejoins the same
way. A broadcast and a rejoin never interleave (one lock), so an engine cannot miss a load that lands while it
rejoins.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import httpx

from .security import WEIGHTS_OVER_HTTP

# SGLang's and serve's loads, and vLLM's (the dev-mode /collective_rpc: the trainer calls reload_weights through it)
WEIGHT_LOADS = ("/update_weights_from_disk", WEIGHTS_OVER_HTTP, "/collective_rpc")
# the broadcasts that change what an engine computes with, replayed to a rejoining engine; pausing, continuing,
# aborting and flushing concern the requests of the moment and are not
ADAPTERS = ("/load_lora_adapter", "/unload_lora_adapter", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
REPLAYED = (*WEIGHT_LOADS, "/update_weight_version", *ADAPTERS)


class RejoinError(RuntimeError):
    """A rejoining engine refused a replayed call or answered another weight version."""


@dataclass(frozen=True)
class StateCall:
    method: str
    path: str
    target: str  # the path with its query, as the client sent it
    body: bytes
    headers: dict


class Membership:
    def __init__(self):
        self.calls: list[StateCall] = []
        self.version: str | None = None  # the weight_version every engine in rotation answered last
        self.left: set[str] = set()
        self.rejoined = 0
        self._lock: asyncio.Lock | None = None

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:  # made on the router's own loop
            self._lock = asyncio.Lock()
        return self._lock

    def record(self, call: StateCall, answers: list) -> None:
        """A broadcast every engine in rotation took: kept for the next rejoin (a weight load replaces the one
        before it and the renames that followed it)."""
        if call.path not in REPLAYED:
            return
        if call.path in WEIGHT_LOADS:
            self.calls = [c for c in self.calls if c.path not in (*WEIGHT_LOADS, "/update_weight_version")]
        self.calls.append(call)
        # SGLang and serve answer the version they hold; vLLM's /update_weight_version the one it was given
        versions = {a.get("weight_version", a.get("new_version")) for a in answers if isinstance(a, dict)} - {None}
        if len(versions) == 1:
            self.version = versions.pop()

    async def replay(self, client: httpx.AsyncClient, url: str, admin: dict) -> str | None:
        """The recorded calls to the engine at ``url``, then its weight_version checked; returns it."""
        for call in self.calls:
            reply = await client.request(
                call.method, url + call.target, content=call.body, headers={**call.headers, **admin}
            )
            answer = json_or_text(reply)
            if reply.status_code != 200 or (isinstance(answer, dict) and answer.get("success") is False):
                raise RejoinError(
                    f"{url}: replaying {call.path} answered HTTP {reply.status_code}: {str(answer)[:300]}"
                )
        version = await weight_version(client, url, admin)
        if self.version is not None and version != self.version:
            raise RejoinError(f"{url}: weight_version {version!r} after the replay, the others hold {self.version!r}")
        return version


async def weight_version(client: httpx.AsyncClient, url: str, admin: dict) -> str | None:
    """The engine's ``weight_version``: SGLang's and serve's ``/model_info``, else vLLM's ``/weight_info``."""
    for path in ("/model_info", "/weight_info"):
        reply = await client.get(url + path, headers=admin)
        if reply.status_code == 404:
            continue
        info = json_or_text(reply)
        return info.get("weight_version") if isinstance(info, dict) else None
    return None


def json_or_text(reply: httpx.Response):
    """An answer's JSON, or its text when it is not JSON (the router relays either)."""
    try:
        return reply.json()
    except ValueError:
        return reply.text
