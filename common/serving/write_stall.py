"""A bound on how long a reply may wait for its client to accept bytes.

uvicorn's ``send`` waits on flow control while its transport buffer is above the high-water
mark, so a client that stops reading (a silent proxy, a consumer that opened the stream and
never reads) makes a streaming reply wait for as long as TCP keeps answering its zero-window
probes: forever, on a live host. Until then the engine request behind the stream keeps its
KV blocks and its running slot, and its outputs pile up in memory.

:class:`WriteStallGuard`, the outermost ASGI layer (it needs the server's own ``send``),
bounds every body ``send``. Past ``--stream-write-timeout-s`` it logs one line naming the
request, resets the connection (RST: no kernel buffer is left holding the unread bytes)
and lets uvicorn see it as lost; from there a stalled client is a disconnected one, and the
paths that already handle a disconnect abort the work (the node's engine request, or both
of the proxy's legs).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
from typing import Any

from starlette.applications import Starlette
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)
_LINGER_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() sends RST and drops the buffers


class StreamStalled(OSError):
    """The client accepted no bytes within the bound (raised only where the connection cannot be
    reset; an OSError, which Starlette treats as the client being gone)."""


class WriteStallGuard:
    """Bound each ``http.response.body`` send of ``app`` by ``seconds``."""

    def __init__(self, app: ASGIApp, seconds: float) -> None:
        self.app, self.seconds = app, seconds

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cycle = getattr(send, "__self__", None)  # uvicorn's RequestResponseCycle
        transport = getattr(cycle, "transport", None)
        flow = getattr(cycle, "flow", None)
        request_id = _header(scope.get("headers", []), b"x-request-id") or "-"

        async def bounded_send(message: Message) -> None:
            nonlocal request_id
            if message["type"] != "http.response.body":
                if message["type"] == "http.response.start":  # the reply names the id the logs use
                    request_id = _header(message.get("headers", []), b"x-request-id") or request_id
                await send(message)
                return
            if flow is not None and not flow.write_paused:  # uvicorn's send waits only while paused:
                await send(message)  # no timer then (it cost one per streamed chunk)
                return
            try:
                async with asyncio.timeout(self.seconds):
                    await send(message)
            except TimeoutError:
                logger.warning("request %s: the client accepted no bytes for %g s (--stream-write-timeout-s);"
                               " aborting the request and resetting its connection", request_id, self.seconds)
                if not _reset(transport):
                    raise StreamStalled(f"client stalled for {self.seconds:g} s") from None
                await asyncio.sleep(0)  # uvicorn's connection_lost runs: the app now sees a disconnect

        await self.app(scope, receive, bounded_send)


def bound_writes(app: Starlette, seconds: float) -> None:
    """Make :class:`WriteStallGuard` the outermost layer of ``app``, outside Starlette's own error
    middleware (which would otherwise wrap the server's ``send`` before the guard sees it)."""
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: WriteStallGuard(build(), seconds)  # type: ignore[method-assign]


def _reset(transport: Any) -> bool:
    if transport is None or not hasattr(transport, "abort"):
        return False
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        except OSError:
            pass  # already closed: abort() below is all there is to do
    transport.abort()
    return True


def _header(headers: Any, name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1")
    return None
