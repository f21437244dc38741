"""Bounded request bodies for the proxy and every node, checked before anything parses them.

An ASGI middleware (not Starlette's BaseHTTPMiddleware, which would re-wrap every
streamed response) reads a POST body itself: a ``Content-Length`` over the limit is
refused before a byte is read, a chunked body as soon as it passes the limit (413).
JSON nested deeper than ``max_depth`` is refused with 400 — the
parsers (``json``, pydantic) recurse, so 3,000 nested ``[`` would otherwise be a
``RecursionError``. The body that passes is handed to the app unchanged; later
``receive`` calls go through, so the app still sees the client's disconnect.
"""

from __future__ import annotations

import itertools
import json
import re

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.serving.errors import error_body, error_type

DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
MAX_JSON_DEPTH = 64  # an OpenAI request nests 4-5 levels; tool schemas a few more
MAX_REQUEST_ID_CHARS = 1024  # a client's X-Request-Id; a proxy's tag with two long host names fits

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def json_depth_exceeds(raw: bytes, limit: int) -> bool:
    """Whether ``raw`` (JSON text, valid or not) nests arrays/objects deeper than ``limit``.

    Runs at C speed: strings are cut out (brackets inside them do not count), the rest
    reduced to brackets, and the running depth's maximum taken.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False  # the common case: too few brackets to nest that deep
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    return max(itertools.accumulate(map(_STEP.__getitem__, brackets)), default=0) > limit


def error_response_messages(status: int, message: str, param: str | None, code: str,
                            request_id: str | None = None) -> list[Message]:
    """The ASGI messages of one OpenAI-shaped JSON error reply."""
    body = json.dumps(error_body(message, error_type(status), param, code)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if request_id:
        headers.append((b"x-request-id", request_id.encode("latin-1")))
    return [{"type": "http.response.start", "status": status, "headers": headers},
            {"type": "http.response.body", "body": body}]


class BodyLimits:
    """Refuse POST bodies over ``max_bytes`` (413) or nested too deep (400)."""

    def __init__(self, app: ASGIApp, max_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 max_depth: int = MAX_JSON_DEPTH) -> None:
        self.app, self.max_bytes, self.max_depth = app, max_bytes, max_depth

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        request_id = headers.get(b"x-request-id", b"").decode("latin-1") or None

        async def refuse(status: int, message: str, param: str | None, code: str) -> None:
            for message_ in error_response_messages(status, message, param, code, request_id):
                await send(message_)

        too_large = (f"the request body is larger than this server's limit of {self.max_bytes} bytes "
                     "(--max-request-bytes)")
        length = headers.get(b"content-length", b"").decode("latin-1")
        if length.isdigit() and int(length) > self.max_bytes:
            await refuse(413, too_large, "body", "request_too_large")
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await refuse(413, too_large, "body", "request_too_large")
                return
            more = message.get("more_body", False)
        if json_depth_exceeds(bytes(body), self.max_depth):
            await refuse(400, f"the request body nests JSON deeper than {self.max_depth} levels", "body",
                         "nesting_too_deep")
            return
        await self.app(scope, replay_body(bytes(body), receive), send)


def replay_body(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that returns the body read already, then the real messages (disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
