"""The proxy's keep-alive pool to its nodes: a stack of idle connections per node.

Taking and returning a connection is O(1) (httpcore's pool rescanned every connection
per request, quadratic in the pool's size). A connection goes back only when its
response was read to the end and the node kept it open; any other close (an error, a
cancelled leg) closes the socket, so the node sees the disconnect and aborts.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import AsyncIterator

from proxy.http_client import Connection, TransportError, open_connection, request_bytes


class Response:
    """A node's answer: status and headers at once, the body read whole or piece by piece."""

    def __init__(self, pool: PooledTransport, address: str, conn: Connection, status: int, headers: dict[str, str]):
        self._pool, self._address, self._conn = pool, address, conn
        self.status_code = status
        self.headers = headers
        self.content = b""
        self._done = False

    async def aread(self) -> bytes:
        """The whole body (also kept in ``content``); the connection is released after."""
        try:
            self.content = b"".join([piece async for piece in self.aiter_raw()])
        finally:
            await self.aclose()
        return self.content

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """Body pieces as they arrive, de-chunked but otherwise untouched."""
        while (piece := await self._conn.next_piece()) is not None:
            yield piece

    @property
    def released(self) -> bool:
        """The connection went back to the pool or was closed: nothing is left to release."""
        return self._done

    async def aclose(self) -> None:
        """Release the connection: back to the pool if reusable, closed otherwise."""
        if not self._done:
            self._done = True
            self._pool._give_back(self._address, self._conn)


class PooledTransport:
    """POSTs to nodes over pooled HTTP/1.1 keep-alive connections."""

    def __init__(self, max_idle_per_origin: int = 256, keepalive_expiry_s: float = 4.0,
                 connect_timeout_s: float = 5.0):
        self.max_idle = max_idle_per_origin
        # Below uvicorn's 5 s keep-alive, so we drop an idle socket before the node does.
        self.keepalive_expiry_s = keepalive_expiry_s
        self.connect_timeout_s = connect_timeout_s
        self._idle: defaultdict[str, list[Connection]] = defaultdict(list)

    async def post(self, address: str, path: str, body: bytes, headers: list[tuple[str, str]]) -> Response:
        """Send a JSON POST to ``host:port``; returns once the response's headers are in.

        Raises TransportError (ConnectError / ConnectTimeout when nothing was sent). If the
        caller is cancelled meanwhile, the connection is closed.
        """
        conn = await self._take(address)
        try:
            conn.send(request_bytes(address, path, body, headers))
            status, response_headers = await conn.read_head()
        except BaseException:
            conn.close()
            raise
        return Response(self, address, conn, status, response_headers)

    async def _take(self, address: str) -> Connection:
        idle = self._idle[address]
        now = time.monotonic()
        while idle:
            conn = idle.pop()
            if now - conn.idle_since < self.keepalive_expiry_s and conn.still_open():
                return conn
            conn.close()
        host, _, port = address.rpartition(":")
        return await open_connection(host.strip("[]"), int(port), self.connect_timeout_s)

    def _give_back(self, address: str, conn: Connection) -> None:
        idle = self._idle[address]
        if conn.reusable() and len(idle) < self.max_idle:
            conn.idle_since = time.monotonic()
            idle.append(conn)
        else:
            conn.close()

    @property
    def released(self) -> bool:
        """The connection went back to the pool or was closed: nothing is left to release."""
        return self._done

    async def aclose(self) -> None:
        for idle in self._idle.values():
            for conn in idle:
                conn.close()
        self._idle.clear()

    async def __aenter__(self) -> PooledTransport:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


__all__ = ["PooledTransport", "Response", "TransportError"]
