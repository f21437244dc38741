"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``, never a traceback.

Route code raises :class:`OpenAIError`; the handlers installed by :func:`install_error_handlers`
turn it, FastAPI's request-validation errors (422 by default, 400 here, as OpenAI does)
and stray HTTP errors into that body.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.engine.outputs import NODE_DRAINING
from common.metrics import NodeMetrics
from common.request_id import parse_tags

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"

# OpenAI's ``type`` for each status it uses; ``code`` is a word (``model_not_found``), never the status.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    499: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


# The ``code`` of an error raised without its own word: never null (clients branch on it).
STATUS_CODES = {
    400: "invalid_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    408: "request_timeout",
    413: "request_too_large",
    429: "rate_limited",
    500: "internal_error",
    502: "upstream_error",
    503: "service_unavailable",
    504: "timeout",
}


def default_code(status: int) -> str:
    """The ``code`` for an error with no more specific word."""
    return STATUS_CODES.get(status, "invalid_request" if status < 500 else "internal_error")


def error_type(status: int) -> str:
    """The OpenAI ``type`` for an HTTP status (4xx: the client's request, 5xx: ours)."""
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")


def error_body(message: str, type: str, param: str | None, code: str) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``: the one error shape of proxy and nodes
    (``code`` is always a word; ``param`` may be null)."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class OpenAIError(Exception):
    """A request that cannot be served; ``status`` is the HTTP status of the reply."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str | None = None,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type or error_type(status)
        self.param = param
        self.code = code or default_code(status)
        self.request_id: str | None = None  # set once the route knows it, echoed in the header

    def body(self) -> dict[str, Any]:
        return error_body(hide_tag(self.message, self.request_id), self.type, self.param, self.code)

    def response(self) -> JSONResponse:
        headers = {REQUEST_ID_HEADER: self.request_id} if self.request_id else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def client_visible_id(request_id: str) -> str:
    """What a client may see of a request id: a proxy's tag shrinks to its uuid (the topology
    stays private)."""
    return request_id.rsplit("_", 1)[-1] if parse_tags(request_id) is not None else request_id


def hide_tag(message: str, request_id: str | None) -> str:
    """``message`` with a tagged request id in it replaced by its uuid."""
    if request_id and parse_tags(request_id) is not None:
        return message.replace(request_id, client_visible_id(request_id))
    return message


def error_kind(status: int) -> str | None:
    """The ``kind`` label of ``request_errors_total`` for an HTTP status.

    None for 502: engine failures are counted where the engine reports them, so that
    streamed and non-streamed ones count the same way.
    """
    if status == 502:
        return None
    if status >= 500:
        return "internal"
    return "invalid_request"


def engine_error(message: str | None, param: str | None = None, code: str | None = None) -> OpenAIError:
    """The engine ended a request with an error: a 400 naming ``param`` when the request is at fault
    (its response_format could not be followed), else a 502 (the node's: another node may serve it),
    whose ``code`` says where it came from (``kv_transfer_failed``: the prefill end), else ``engine_error``;
    a 503 when the node stopped serving it (``node_draining``: a role flip's drain ran out)."""
    if param is not None:
        return OpenAIError(message or "the request cannot be served", status=400, param=param,
                           code="response_format_failed")
    if code == NODE_DRAINING:
        return OpenAIError(message or "the node stopped serving the request", status=503, code=code)
    return OpenAIError(message or "the engine failed the request", status=502, code=code or "engine_error")


@contextmanager
def openai_errors(request_id: str) -> Iterator[None]:
    """Tag OpenAI errors with the request id; turn anything unexpected into a logged 500."""
    try:
        yield
    except OpenAIError as exc:
        exc.request_id = request_id
        raise
    except Exception as exc:
        logger.exception("unexpected error (request id %s)", request_id)
        raise internal_error(request_id) from exc


def internal_error(request_id: str | None) -> OpenAIError:
    err = OpenAIError(
        f"internal server error (request id {request_id}); see the server log",
        status=500,
        code="internal_error",
    )
    err.request_id = request_id
    return err


def model_not_served(model: object, served: list[str]) -> str:
    """vLLM's words for a model nobody here serves, and what is (proxy and nodes say the same)."""
    return f"The model `{model}` does not exist; served here: {', '.join(served) or 'none'} (see /v1/models)."


def invalid_json(position: int | None) -> OpenAIError:
    """One message for a body that does not parse, whichever parser found it (proxy or node)."""
    where = f" (at character {position})" if position is not None else ""
    return OpenAIError(f"request body is not valid JSON{where}", param="body", code="invalid_json")


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """The first problem of a body that failed validation, naming the field."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request body", param="body", code="invalid_body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        # FastAPI puts the parser's character offset in the location, after "body"
        return invalid_json(next((p for p in first.get("loc", ()) if isinstance(p, int)), None))
    if not loc:  # the body itself: empty, or not an object
        if first.get("type") == "missing":
            return OpenAIError("the request body is empty; send a JSON object", param="body",
                               code="missing_body")
        return OpenAIError("the request body must be a JSON object", param="body", code="invalid_body")
    param = loc[0]
    field = ".".join(loc)
    message = first.get("msg", "invalid value").replace("Input should", "should").replace("Value error, ", "")
    if first.get("type") == "missing":
        return OpenAIError(f"'{param}' is required", param=param, code="missing_field")
    return OpenAIError(f"'{field}': {message}", param=param, code="invalid_value")


def body_error(content_type: str | None, body: bytes) -> OpenAIError | None:
    """What is wrong with a body as a whole (not JSON at all, or nothing), as the proxy says it too."""
    if not content_type or "json" not in content_type.lower():  # none at all: the proxy would parse it, a node not
        sent = repr(content_type) if content_type else "none was sent"
        return OpenAIError(f"Content-Type must be application/json ({sent})", param="body",
                           code="invalid_content_type")
    if not body.strip():
        return OpenAIError("the request body is empty; send a JSON object", param="body", code="missing_body")
    return None


def http_error(request: Request, status: int, detail: str) -> OpenAIError:
    """Starlette's own errors (no such route, wrong method, unparsable body) in OpenAI's shape."""
    method, path = request.method, request.url.path
    if status == 404:
        return OpenAIError(f"no route {method} {path}; this server has /v1/completions, "
                           "/v1/chat/completions, /v1/models, /health, /ready, /metrics",
                           status=404, code="unknown_url")
    if status == 405:
        return OpenAIError(f"method {method} is not allowed on {path}", status=405, code="method_not_allowed")
    if status == 400:
        return OpenAIError(f"cannot parse the request body: {detail}", param="body", code="invalid_json")
    return OpenAIError(detail, status=status)


def install_error_handlers(app: FastAPI, metrics: NodeMetrics) -> None:
    """Every error leaves as an OpenAI error body and is counted."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        kind = error_kind(exc.status)
        if kind is not None:
            metrics.observe_error(kind)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        err = body_error(request.headers.get("content-type"), await request.body()) or validation_error(exc)
        err.request_id = request.headers.get(REQUEST_ID_HEADER)
        metrics.observe_error("invalid_request")
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = http_error(request, exc.status_code, str(exc.detail))
        err.request_id = request.headers.get(REQUEST_ID_HEADER)
        metrics.observe_error("invalid_request" if exc.status_code < 500 else "internal")
        response = err.response()
        response.headers.update(exc.headers or {})  # 405's Allow
        return response

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        logger.exception("unexpected error serving %s (request id %s)", request.url.path, request_id)
        metrics.observe_error("internal")
        return internal_error(request_id).response()
