"""Errors the proxy answers with, always as OpenAI-style bodies.

``{"error": {"message", "type", "param", "code"}}`` with a status that says whose
fault it was: 4xx the client's, 502/504 a node's, 503 no node to send it to.
"""

from __future__ import annotations

import json

from starlette.responses import Response


def error_body(message: str, err_type: str, code: int | str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


class ProxyError(Exception):
    """An error the client should see; ``kind`` labels the errors metric."""

    status = 500
    err_type = "internal_error"
    kind = "internal"

    def __init__(self, message: str, status: int | None = None, body: bytes | None = None):
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status
        self._body = body  # a node's own OpenAI-style error body, relayed as is

    def body_bytes(self) -> bytes:
        if self._body is not None:
            return self._body
        return json.dumps(error_body(self.message, self.err_type, self.status)).encode()

    def response(self) -> Response:
        return Response(self.body_bytes(), status_code=self.status, media_type="application/json")

    def sse_event(self) -> bytes:
        """The same error as an SSE event followed by [DONE], for a stream already begun."""
        body = json.dumps(error_body(self.message, self.err_type, self.status))
        return f"data: {body}\n\ndata: [DONE]\n\n".encode()


class BadRequest(ProxyError):
    status, err_type, kind = 400, "invalid_request_error", "bad_request"


class Unauthorized(ProxyError):
    status, err_type, kind = 401, "authentication_error", "unauthorized"


class ModelNotFound(ProxyError):
    status, err_type, kind = 404, "not_found_error", "model_not_found"


class NoNodeAvailable(ProxyError):
    status, err_type, kind = 503, "service_unavailable", "no_node"


class UpstreamError(ProxyError):
    """A node answered with an error status; its body is relayed when it is OpenAI-style."""

    err_type, kind = "upstream_error", "upstream_status"

    def __init__(self, role: str, node: str, status: int, body: bytes):
        message = f"{role} node {node} answered {status}: {_short(body)}"
        super().__init__(message, status=status, body=body if _is_openai_error(body) else None)
        self.role, self.node = role, node


class UpstreamUnreachable(ProxyError):
    """Could not connect to or talk with a node (or it answered nothing usable)."""

    status, err_type, kind = 502, "bad_gateway", "upstream_unreachable"

    def __init__(self, role: str, node: str, detail: str):
        super().__init__(f"{role} node {node} failed: {detail}")
        self.role, self.node = role, node


class UpstreamTimeout(ProxyError):
    status, err_type, kind = 504, "gateway_timeout", "timeout"

    def __init__(self, role: str, node: str, phase: str, seconds: float):
        super().__init__(f"{role} node {node} exceeded the {phase} timeout ({seconds:g} s)")
        self.role, self.node = role, node


class RequestTimeout(ProxyError):
    status, err_type, kind = 504, "gateway_timeout", "timeout"


class ClientDisconnected(Exception):
    """The client went away; both legs are aborted and nothing is answered."""


def is_retryable(exc: BaseException) -> bool:
    """A prefill refusal worth trying elsewhere: unreachable node or 503."""
    if getattr(exc, "role", None) != "prefill":
        return False
    return isinstance(exc, UpstreamUnreachable) or (isinstance(exc, UpstreamError) and exc.status == 503)


def _is_openai_error(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and isinstance(data.get("error"), dict) and "message" in data["error"]


def _short(body: bytes, limit: int = 300) -> str:
    text = body.decode("utf-8", "replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."
