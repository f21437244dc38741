"""Fake prefill/decode nodes and a uvicorn-in-a-thread server for the proxy tests.

A fake node is a tiny FastAPI app that records what it received (headers, body,
arrival and finish times, whether the caller went away) and answers as its
``behavior`` says: status, delay, SSE chunks.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI, Request
from helpers.waiting import wait_for
from starlette.responses import Response, StreamingResponse

SSE_CHUNKS = [
    b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"Hel"}]}\n\n',
    b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"lo \\u00e9"}]}\n\n',
    b'data: {"id":"x","object":"text_completion","choices":[{"index":0,"text":"!","finish_reason":"stop"}]}\n\n',
    b"data: [DONE]\n\n",
]


@dataclass
class Seen:
    request_id: str | None
    body: dict
    arrived: float
    client_port: int = 0  # tells pooled (reused) connections from new ones
    finished: float | None = None
    cancelled: bool = False


@dataclass
class Behavior:
    status: int = 200
    delay_s: float = 0.0  # before answering (P: the whole leg; D: before the first chunk)
    chunk_delay_s: float = 0.0
    chunks: list[bytes] = field(default_factory=lambda: list(SSE_CHUNKS))
    error_body: bytes = b'{"error":{"message":"fake failure","type":"server_error","param":null,"code":"internal_error"}}'
    # D: answer only once one of these nodes has seen the same request id (a real decode node
    # cannot finish before its prefill node got the request; a fake one otherwise can, and the
    # proxy then cancels a prefill leg that never arrived)
    after: tuple[FakeNode, ...] = ()


class FakeNode:
    """A fake node; ``role`` is 'P' or 'D'."""

    def __init__(self, role: str, name: str = "fake"):
        self.role, self.name = role, name
        self.behavior = Behavior()
        self.seen: list[Seen] = []
        self.app = self._build()

    def _build(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        @app.post("/v1/chat/completions")
        async def complete(request: Request) -> Response:
            seen = Seen(request.headers.get("x-request-id"), json.loads(await request.body()), time.monotonic(),
                        request.client.port)
            self.seen.append(seen)
            b = self.behavior
            if b.after:
                await _until_seen(b.after, seen.request_id)
            if await _sleep_unless_gone(request, b.delay_s):
                seen.cancelled = True
                return Response(status_code=499)
            if b.status != 200:
                seen.finished = time.monotonic()
                return Response(b.error_body, status_code=b.status, media_type="application/json")
            if seen.body.get("stream"):
                return StreamingResponse(self._stream(seen), media_type="text/event-stream")
            seen.finished = time.monotonic()
            return Response(self._json(seen), media_type="application/json")

        return app

    def _json(self, seen: Seen) -> bytes:
        return json.dumps({"id": seen.request_id, "object": "text_completion", "node": self.name,
                           "choices": [{"index": 0, "text": "Hello", "finish_reason": "stop"}]}).encode()

    async def _stream(self, seen: Seen):
        try:
            for chunk in self.behavior.chunks:
                yield chunk
                await asyncio.sleep(self.behavior.chunk_delay_s)
            seen.finished = time.monotonic()
        except asyncio.CancelledError:
            seen.cancelled = True
            raise


async def _until_seen(nodes: tuple[FakeNode, ...], request_id: str | None, timeout_s: float = 10.0) -> None:
    end = time.monotonic() + timeout_s
    while not any(x.request_id == request_id for node in nodes for x in node.seen):
        assert time.monotonic() < end, f"none of {[n.name for n in nodes]} got {request_id}"
        await asyncio.sleep(0.005)


async def _sleep_unless_gone(request: Request, seconds: float) -> bool:
    """Sleep, polling for the caller's disconnect; True when it went away."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if await request.is_disconnected():
            return True
        await asyncio.sleep(0.01)
    return False


class ServerThread:
    """A real uvicorn server on a free loopback port, in a daemon thread."""

    def __init__(self, app, port: int = 0):
        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False,
                                lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> ServerThread:
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), 10)
        if not self.server.started:
            raise RuntimeError("uvicorn did not start")
        return self

    def __enter__(self) -> ServerThread:
        return self.start()

    @property
    def port(self) -> int:
        return self.server.servers[0].sockets[0].getsockname()[1]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def __exit__(self, *exc) -> None:
        stop_servers([self])


def stop_servers(servers: list[ServerThread]) -> None:
    """Stop ``servers`` together: each takes a few of uvicorn's 0.1 s ticks to shut down."""
    for server in servers:
        server.server.should_exit = True
    for server in servers:
        server.thread.join(timeout=10)
