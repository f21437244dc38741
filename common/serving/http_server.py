"""The HTTP server every pdserve process runs (proxy and nodes): uvicorn with bounded clients.

uvicorn bounds an idle keep-alive connection, but not a client that is still sending: one
that trickles its headers or its body a byte at a time, or connects and sends nothing,
holds its socket (a file descriptor) forever. Its ``limit_concurrency`` answers 503 only
once headers are complete. So the protocol here, uvicorn's httptools one with deadlines:

- **connections** past ``max_connections`` get a 503 and are closed as they arrive (the
  FD is released at once; the clients already connected are served as before);
- **headers**: from the connection's start (or a keep-alive request's first byte) to the
  end of its headers, at most ``header_timeout_s``; then a 408 and the connection closes;
- **body**: from the end of the headers to the body's last byte, at most
  ``body_timeout_s``; then a 408 if nothing was answered yet, the app sees a disconnect
  (the node aborts the request) and the connection closes. A response sent before the
  body ended (401, 403, 413) does not keep a trickling body's connection open either.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import resource
from dataclasses import dataclass
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from common.serving.errors import error_body, error_type

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HttpLimits:
    """How long a client may take to send a request, and how many may be connected."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    max_connections: int = 1024


def _reply(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(error_body(message, error_type(status), None, code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class _BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol with a connection cap and header / body deadlines."""

    limits: HttpLimits  # set on the subclass ``bounded_protocol`` makes

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.transport = transport  # connection_lost closes it again; nothing else is set up
            transport.write(_reply(503, "Service Unavailable", "too many open connections "
                                   f"(--http-max-connections {self.limits.max_connections}); retry later",
                                   "too_many_connections"))
            transport.close()
            return
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, "header")

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm(self.limits.header_timeout_s, "header")

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._arm(self.limits.body_timeout_s, "body")

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def _arm(self, seconds: float, part: str) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expired, part, seconds)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expired(self, part: str, seconds: float) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        if part == "header":  # a new request: answer unless the previous one's response is still going out
            answer = cycle is None or cycle.response_complete
        else:  # a body: answer unless the app already did (a 401 / 413 before the body ended)
            answer = cycle is not None and not cycle.response_started
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True  # the app's receive() says so; its sends are dropped from here
            cycle.message_event.set()
        if answer:
            flag = f"--http-{part}-timeout-s"
            self.transport.write(_reply(408, "Request Timeout", f"the request's {part} did not arrive within "
                                        f"{seconds:g} s ({flag})", "request_timeout"))
        logger.info("closed a connection from %s: request %s not complete after %g s", self.client, part, seconds)
        self.transport.close()


def bounded_protocol(limits: HttpLimits) -> type[HttpToolsProtocol]:
    """An httptools protocol class enforcing ``limits`` (uvicorn makes one instance per connection)."""
    return type("BoundedHttpTools", (_BoundedHttpTools,), {"limits": limits})


def server_config(app: Any, host: str, port: int, limits: HttpLimits, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config for ``app`` that enforces ``limits``; ``kwargs`` go to uvicorn as they are."""
    _raise_fd_limit(limits.max_connections)
    return uvicorn.Config(app, host=host, port=port, http=bounded_protocol(limits), **kwargs)


def freeze_startup_heap() -> None:
    """Take what the process built at start (model, tokenizer and grammar tables, routes) out of the
    cyclic garbage collector's scans, just before it serves. A full collection scans every tracked
    object and holds the GIL meanwhile, so the engine thread and every request wait: on this 2-core
    machine a node's full collections took 137-174 ms while it served (gc callbacks in a
    ``bench/fairness.py`` run); what serving creates is still collected."""
    gc.collect()
    gc.freeze()


def _raise_fd_limit(max_connections: int) -> None:
    """Lift the soft FD limit towards the hard one so the connection cap, not EMFILE, is what refuses."""
    want = max_connections + 1024  # the process's own sockets: the pool to nodes, ZMQ, files
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < want:
        new = want if hard == resource.RLIM_INFINITY else min(want, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError):
            new = soft
        if new < want:
            logger.warning("open file limit %d is below --http-max-connections %d + 1024; raise it "
                           "(ulimit -n) or lower the cap", new, max_connections)
