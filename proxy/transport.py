"""An httpx transport whose keep-alive pool costs O(1) per request.

httpcore's ``AsyncConnectionPool`` rescans every connection on each request and each
response close, and for every idle one it recounts the idle ones: O(connections^2)
per request. Measured here with 32 clients (64 pooled connections, P and D), the proxy
spent most of its time in that scan and fell below 50 requests/s. This pool keeps a
stack of idle connections per origin instead; everything else (HTTP/1.1, timeouts from
the request's extensions, error mapping) is still httpx's and httpcore's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import AsyncIterator

import anyio
import httpcore
import httpx

_ORIGIN = tuple[bytes, bytes, int]


class _CoalescingStream(httpcore.AsyncNetworkStream):
    """Holds writes until the next read, so a request's headers and body leave in one send.

    httpcore writes them separately; on loopback each send is a syscall plus a wakeup
    of the node, which is a large part of what a request costs the proxy.
    """

    def __init__(self, inner: httpcore.AsyncNetworkStream):
        self._inner = inner
        self._pending: list[bytes] = []

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if buffer:
            self._pending.append(buffer)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            await self._inner.write(data, timeout)
        return await self._inner.read(max_bytes, timeout)

    async def aclose(self) -> None:
        self._pending.clear()
        await self._inner.aclose()

    async def start_tls(self, ssl_context, server_hostname=None, timeout=None) -> httpcore.AsyncNetworkStream:
        raise NotImplementedError("the proxy talks plain HTTP to its nodes")

    def get_extra_info(self, info: str):
        return self._inner.get_extra_info(info)


class _CoalescingBackend(httpcore.AsyncNetworkBackend):
    def __init__(self) -> None:
        self._inner = httpcore.AnyIOBackend()

    async def connect_tcp(self, host, port, timeout=None, local_address=None, socket_options=None):
        stream = await self._inner.connect_tcp(host, port, timeout, local_address, socket_options)
        return _CoalescingStream(stream)

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class _StackPool:
    """Idle connections per origin, most recently used first (the warmest socket)."""

    def __init__(self, max_idle_per_origin: int, keepalive_expiry_s: float):
        self.max_idle = max_idle_per_origin
        self.keepalive_expiry_s = keepalive_expiry_s
        self._backend = _CoalescingBackend()
        self._idle: defaultdict[_ORIGIN, list[httpcore.AsyncHTTPConnection]] = defaultdict(list)

    def _take(self, origin: httpcore.Origin) -> httpcore.AsyncHTTPConnection:
        idle = self._idle[(origin.scheme, origin.host, origin.port)]
        while idle:
            conn = idle.pop()
            # has_expired also notices a socket the server closed while it sat idle.
            if conn.is_idle() and not conn.has_expired():
                return conn
        return httpcore.AsyncHTTPConnection(origin=origin, keepalive_expiry=self.keepalive_expiry_s,
                                            network_backend=self._backend)

    def _give_back(self, conn: httpcore.AsyncHTTPConnection, origin: httpcore.Origin) -> bool:
        idle = self._idle[(origin.scheme, origin.host, origin.port)]
        if conn.is_idle() and len(idle) < self.max_idle:
            idle.append(conn)
            return True
        return False

    async def handle_async_request(self, request: httpcore.Request) -> httpcore.Response:
        origin = request.url.origin
        conn = self._take(origin)
        try:
            response = await conn.handle_async_request(request)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await conn.aclose()
            raise
        stream = _ReturningStream(response.stream, self, conn, origin)
        return httpcore.Response(response.status, headers=response.headers, content=stream,
                                 extensions=response.extensions)

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                await conn.aclose()
        self._idle.clear()

    async def __aenter__(self) -> _StackPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _ReturningStream:
    """The response body; closing it puts the connection back when it can be reused."""

    def __init__(self, inner, pool: _StackPool, conn: httpcore.AsyncHTTPConnection, origin: httpcore.Origin):
        self._inner, self._pool, self._conn, self._origin = inner, pool, conn, origin

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self._inner:
            yield chunk

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):  # a half-closed connection must never be reused
            await self._inner.aclose()
            if not self._pool._give_back(self._conn, self._origin):
                await self._conn.aclose()


class PooledTransport(httpx.AsyncHTTPTransport):
    """``httpx.AsyncHTTPTransport`` (plain HTTP) with the O(1) pool above."""

    def __init__(self, max_idle_per_origin: int = 256, keepalive_expiry_s: float = 4.0):
        super().__init__()
        # Below uvicorn's 5 s keep-alive, so we drop an idle socket before the node does.
        self._pool = _StackPool(max_idle_per_origin, keepalive_expiry_s)
