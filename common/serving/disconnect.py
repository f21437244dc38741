"""A non-streaming reply that stops (and aborts its engine requests) when the client leaves.

Starlette cancels a streaming body when the client disconnects, but not a route that is
still awaiting a whole reply: without this, a client that gave up (or a proxy that
cancelled a leg) would leave the engine generating to ``max_tokens``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

_T = TypeVar("_T")


class ClientGone(Exception):
    """The client closed the connection before the reply was ready."""


async def unless_disconnected(work: Awaitable[_T], request: Request) -> _T:
    """``await work``, cancelled (its ``finally`` aborts the engine requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            return task.result()
        raise ClientGone()
    finally:
        for pending in (task, watcher):
            pending.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    # The body was read already; what the server hands over next is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
