"""One HTTP/1.1 client connection to a node: an asyncio Protocol fed to httptools' parser.

The proxy only ever POSTs JSON to its own nodes over plain HTTP, so a connection needs
little: one write per request (headers and body together), a response parsed by
httptools (uvicorn's C parser; it also de-chunks), and the body handed over piece by
piece as it arrives so SSE relays stay unbuffered. httpx/httpcore did the same for
about 0.44 ms of CPU per request, twice per client request (the P and D legs).
"""

from __future__ import annotations

import asyncio
import select
import socket
from collections import deque

import httptools

_PAUSE_AT = 64  # body pieces waiting for a slow reader before we stop reading the socket
# A node behind a partition sends no FIN and no RST: without probes a leg waiting for its
# answer would wait out the leg's whole timeout. Keep-alive probes after 2 s of silence,
# and a 5 s limit on unacknowledged data, make such a socket fail in about 5 s instead.
_SILENCE_OPTIONS = [("SO_KEEPALIVE", socket.SOL_SOCKET, 1), ("TCP_KEEPIDLE", socket.IPPROTO_TCP, 2),
                    ("TCP_KEEPINTVL", socket.IPPROTO_TCP, 1), ("TCP_KEEPCNT", socket.IPPROTO_TCP, 3),
                    ("TCP_USER_TIMEOUT", socket.IPPROTO_TCP, 5000)]


class TransportError(Exception):
    """The connection failed: refused, reset, closed early, or sent something unparsable."""


class ConnectError(TransportError):
    """The node could not be connected to (nothing was sent)."""


class ConnectTimeout(TransportError):
    """Connecting took longer than the connect timeout (nothing was sent)."""


class Connection(asyncio.Protocol):
    """One keep-alive socket; carries one request/response at a time."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpResponseParser(self)
        self._loop = asyncio.get_running_loop()
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.status = 0
        self.keep_alive = False
        self.complete = False
        self._header_list: list[tuple[bytes, bytes]] = []
        self._head: asyncio.Future[None] = self._loop.create_future()
        self._pieces: deque[bytes] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._error: TransportError | None = None
        self._paused = False

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        sock = transport.get_extra_info("socket")
        for name, level, value in _SILENCE_OPTIONS:
            if sock is not None and hasattr(socket, name):  # the TCP_* ones are Linux's
                sock.setsockopt(level, getattr(socket, name), value)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(TransportError(f"bad response from node: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if not self.complete:
            self._fail(TransportError(f"connection closed before the response ended ({exc or 'EOF'})"))

    # httptools callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_list.append((name, value))

    def on_headers_complete(self) -> None:
        self.status = self._parser.get_status_code()
        self.keep_alive = self._parser.should_keep_alive()
        if not self._head.done():
            self._head.set_result(None)

    def on_body(self, body: bytes) -> None:
        self._pieces.append(body)
        if len(self._pieces) >= _PAUSE_AT and not self._paused and self._transport is not None:
            self._paused = True
            self._transport.pause_reading()
        self._wake()

    def on_message_complete(self) -> None:
        self.complete = True
        self._wake()

    # used by the pool and Response
    def send(self, data: bytes) -> None:
        """Write one whole request; the previous response must have been read to its end."""
        self._reset()
        assert self._transport is not None
        self._transport.write(data)

    async def read_head(self) -> tuple[int, dict[str, str]]:
        """The response's status and headers (names lower-cased)."""
        await self._head
        if self._error is not None and not self.status:
            raise self._error
        return self.status, {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in self._header_list}

    async def next_piece(self) -> bytes | None:
        """The next piece of the (de-chunked) body as it arrived; None at its end."""
        while not self._pieces:
            if self.complete:
                return None
            if self._error is not None:
                raise self._error
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if self._paused and len(self._pieces) <= 1 and self._transport is not None:
            self._paused = False
            self._transport.resume_reading()
        return self._pieces.popleft()

    def reusable(self) -> bool:
        """Whether the socket can carry another request: response ended, node kept it open."""
        return self.complete and self.keep_alive and not self.closed and self._transport is not None

    def still_open(self) -> bool:
        """For an idle connection: False when the node has closed it meanwhile.

        Checked on the socket itself: the loop may not have run connection_lost yet.
        """
        if not self.reusable():
            return False
        sock = self._transport.get_extra_info("socket")
        # A readable idle socket means the node closed it (or sent junk): either way, drop it.
        return sock is not None and not select.select([sock.fileno()], [], [], 0)[0]

    def close(self) -> None:
        """Close the socket now; a node mid-request sees the disconnect and aborts."""
        self.closed = True
        if self._transport is not None:
            self._transport.close()

    def _fail(self, error: TransportError) -> None:
        if self._error is None:
            self._error = error
        if not self._head.done():
            self._head.set_result(None)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)


async def open_connection(host: str, port: int, timeout_s: float) -> Connection:
    """A new connection; ConnectError / ConnectTimeout when the node cannot be reached."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout_s):
            _, conn = await loop.create_connection(Connection, host, port)
    except TimeoutError as exc:
        raise ConnectTimeout(f"connecting to {host}:{port} took over {timeout_s:g} s") from exc
    except OSError as exc:
        raise ConnectError(f"cannot connect to {host}:{port}: {exc}") from exc
    return conn


def request_bytes(host: str, path: str, body: bytes, headers: list[tuple[str, str]],
                  method: str = "POST") -> bytes:
    """A request with a JSON body, head and body in one buffer (one write, one segment)."""
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}", "content-type: application/json",
             f"content-length: {len(body)}"]
    lines.extend(f"{k}: {v}" for k, v in headers)
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def get_json_once(address: str, path: str, timeout_s: float) -> tuple[int, bytes]:
    """One GET on a fresh connection, closed after (for rare calls such as a node's /v1/models)."""
    host, _, port = address.rpartition(":")
    conn = await open_connection(host.strip("[]"), int(port), timeout_s)
    try:
        async with asyncio.timeout(timeout_s):
            conn.send(request_bytes(address, path, b"", [("connection", "close")], method="GET"))
            status, _ = await conn.read_head()
            pieces = []
            while (piece := await conn.next_piece()) is not None:
                pieces.append(piece)
    finally:
        conn.close()
    return status, b"".join(pieces)

