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

from common.metrics import NodeMetrics

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"


class OpenAIError(Exception):
    """A request that cannot be served; ``status`` is the HTTP status of the reply."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.request_id: str | None = None  # set once the route knows it, echoed in the header

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        headers = {REQUEST_ID_HEADER: self.request_id} if self.request_id else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


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


def engine_error(message: str | None) -> OpenAIError:
    return OpenAIError(message or "the engine failed the request", status=502, type="engine_error")


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
        type="internal_server_error",
    )
    err.request_id = request_id
    return err


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """The first problem of a body that failed validation, naming the field."""
    errors = exc.errors()
    if not errors:
        return OpenAIError("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(f"request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": "))
    param = loc[0] if loc else None
    field = ".".join(loc) if loc else "body"
    message = first.get("msg", "invalid value").replace("Input should", "should")
    if first.get("type") == "missing":
        return OpenAIError(f"'{param}' is required", param=param, code="missing_field")
    return OpenAIError(f"'{field}': {message}", param=param)


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
        err = validation_error(exc)
        err.request_id = request.headers.get(REQUEST_ID_HEADER)
        metrics.observe_error("invalid_request")
        return err.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = OpenAIError(str(exc.detail), status=exc.status_code, type="invalid_request_error")
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        request_id = request.headers.get(REQUEST_ID_HEADER)
        logger.exception("unexpected error serving %s (request id %s)", request.url.path, request_id)
        metrics.observe_error("internal")
        return internal_error(request_id).response()
