"""Errors the proxy answers with, always as OpenAI-style bodies.

``{"error": {"message", "type", "param", "code"}}`` with a status that says whose
fault it was: 4xx the client's, 502/504 a node's, 503 no node to send it to.
"""

from __future__ import annotations

import json

from starlette.responses import Response

from common.serving.errors import error_body, error_type


class ProxyError(Exception):
    """An error the client should see; ``kind`` labels the errors metric, ``code`` is OpenAI's word."""

    status = 500
    code: str = "internal_error"
    kind = "internal"
    param: str | None = None
    role: str | None = None  # the node's role and address, when a node is to blame
    node: str | None = None

    def __init__(self, message: str, status: int | None = None, body: bytes | None = None,
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        if param is not None:
            self.param = param
        if code is not None:
            self.code = code
        self._body = body  # a node's own OpenAI-style error body, relayed as is

    def body_dict(self) -> dict:
        return error_body(self.message, error_type(self.status), self.param, self.code)

    def body_bytes(self) -> bytes:
        if self._body is not None:
            return self._body
        return json.dumps(self.body_dict(), separators=(",", ":")).encode()

    def response(self, request_id: str | None = None) -> Response:
        headers = {"x-request-id": request_id} if request_id else None
        return Response(self.body_bytes(), status_code=self.status, media_type="application/json",
                        headers=headers)

    def sse_event(self) -> bytes:
        """The same error as an SSE event followed by [DONE], for a stream already begun."""
        body = json.dumps(self.body_dict(), separators=(",", ":"))
        return f"data: {body}\n\ndata: [DONE]\n\n".encode()


class BadRequest(ProxyError):
    status, code, kind, param = 400, "invalid_value", "bad_request", "body"


class ModelNotFound(ProxyError):
    status, code, kind, param = 404, "model_not_found", "model_not_found", "model"


class NoNodeAvailable(ProxyError):
    status, code, kind = 503, "no_node_available", "no_node"


class UpstreamError(ProxyError):
    """A node answered with an error status; its body is relayed when it is OpenAI-style, with
    the ``type`` and ``code`` words filled in where the node left them out or null (vLLM does)."""

    code, kind = "upstream_error", "upstream_status"

    def __init__(self, role: str, node: str, status: int, body: bytes):
        message = f"{role} node {node} answered {status}: {_short(body)}"
        super().__init__(message, status=status, body=_completed(body, status, self.code))
        self.role, self.node = role, node

    def sse_event(self) -> bytes:
        """A node's refusal of the request (4xx) reaches the client as the node wrote it, also
        mid-stream; a node's own failure is told in the proxy's words, naming the node."""
        if self.status < 500 and self._body is not None:
            return b"data: " + self._body + b"\n\ndata: [DONE]\n\n"
        return super().sse_event()


class UpstreamUnreachable(ProxyError):
    """Could not connect to or talk with a node (or it answered nothing usable)."""

    status, code, kind = 502, "upstream_unreachable", "upstream_unreachable"

    def __init__(self, role: str, node: str, detail: str, reached: bool = True):
        super().__init__(f"{role} node {node} failed: {detail}")
        self.role, self.node = role, node
        self.reached = reached  # False: no connection was made (refused, connect timeout), nothing was sent


class UpstreamTimeout(ProxyError):
    status, code, kind = 504, "timeout", "timeout"

    def __init__(self, role: str, node: str, phase: str, seconds: float):
        # ``phase`` names the flag that set the bound: "prefill" -> --prefill-timeout-s
        super().__init__(f"{role} node {node} did not answer within the {phase} timeout "
                         f"({seconds:g} s, --{phase}-timeout-s)")
        self.role, self.node = role, node


class UpstreamStalled(ProxyError):
    """A node that still heartbeats but whose engine has been stuck for ``--node-stall-timeout-s``."""

    status, code, kind = 504, "node_stalled", "stalled"

    def __init__(self, role: str, node: str, stalled_s: float, limit_s: float):
        super().__init__(f"{role} node {node} is stalled: its engine has made no progress for "
                         f"{stalled_s:.0f} s (--node-stall-timeout-s {limit_s:g}) although it still heartbeats")
        self.role, self.node = role, node


class RequestTimeout(ProxyError):
    status, code, kind = 504, "timeout", "timeout"


class StreamIdle(ProxyError):
    """A stream that sent nothing for ``--stream-idle-timeout-s``: ended, both legs cancelled."""

    status, code, kind = 504, "stream_idle_timeout", "stream_idle"

    def __init__(self, node: str, seconds: float):
        super().__init__(f"decode node {node} sent nothing for {seconds:g} s (--stream-idle-timeout-s); "
                         "the stream was ended")
        self.role, self.node = "decode", node


class ClientDisconnected(Exception):
    """The client went away; both legs are aborted and nothing is answered."""


def node_code(exc: BaseException) -> str | None:
    """The ``code`` word of the error body a node sent (an error status's body, or a stream's error
    event), None when there is none."""
    raw = getattr(exc, "event", None) or getattr(exc, "_body", None)
    if not isinstance(raw, bytes):
        return None
    raw = raw.strip()
    raw = raw[5:] if raw.startswith(b"data:") else raw
    try:
        error = json.loads(raw).get("error")
    except (ValueError, AttributeError):
        return None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def is_retryable(exc: BaseException) -> bool:
    """A prefill refusal worth trying elsewhere: unreachable node, 503, or 409 (the node changed role
    since the proxy routed to it, or is draining for a flip: common/node/role_flip.py)."""
    if getattr(exc, "role", None) != "prefill":
        return False
    return isinstance(exc, UpstreamUnreachable) or (isinstance(exc, UpstreamError) and exc.status in (409, 503))


def _completed(body: bytes, status: int, code: str) -> bytes | None:
    """A node's OpenAI-style error body, relayed unchanged when its ``type`` and ``code`` are
    words, else with them filled in (``error_type(status)``, ``code``); None for any other body."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) or "message" not in error:
        return None
    missing = {key: word for key, word in (("type", error_type(status)), ("code", code))
               if not (isinstance(error.get(key), str) and error[key])}
    if not missing:
        return body
    error.update(missing)
    error.setdefault("param", None)
    return json.dumps(data, separators=(",", ":")).encode()


def _short(body: bytes, limit: int = 300) -> str:
    text = body.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."
