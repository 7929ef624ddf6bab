"""Waiting on work while watching for the client to go away, without polling.

A handler that waits on the engine would otherwise ask ``request.is_disconnected()`` every half
second: with a thousand requests in flight that is two thousand wake-ups a second on the event
loop. Here one task per request waits on the ASGI ``receive`` channel, which the server answers
with ``http.disconnect`` once the client has gone (the body was read already).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from starlette.requests import Request


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(
    work: Awaitable, request: Request, on_disconnect: Callable[[asyncio.Future], Awaitable | None]
):
    """``work``'s result; if the client goes away first, ``on_disconnect(task)`` decides (cancel the
    task, or abort what it waits on and keep waiting) and its return value is awaited and returned."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if task in done:
        return task.result()
    follow_up = on_disconnect(task)
    return await follow_up if follow_up is not None else None
