"""The two relay routes (POST /v1/completions, /v1/chat/completions) served in front of FastAPI.

Every client request the proxy relays goes through here, so its per-request cost is the
proxy's throughput. FastAPI's own layers (its error, telemetry and body-size middleware,
routing, dependency solving, per-route exception wrapping) cost about a quarter of the proxy's
CPU per request (bench/proxy_overhead.py, py-spy) and the relay routes need none of them: they
take the raw ``Request`` and return a ``Response``. So the proxy's ASGI entry is

    WriteStallGuard -> RelayFront -> relay POSTs: [ApiKeyOnly] -> BodyLimits -> RelayRoutes
                                  -> anything else: FastAPI's stack ([ApiKeyOnly], BodyLimits, routes)

The same key and body checks guard both ways in; another method on a relay path goes to the
router (405 as before); the relay routes answer errors with the app's own OpenAI error bodies.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.errors import ProxyError

RELAY_PATHS = ("/v1/completions", "/v1/chat/completions")
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


class RelayRoutes:
    """The relay routes' endpoint: ``app.state.dispatcher`` answers, errors get the app's bodies."""

    def __init__(self, app: Starlette, on_proxy_error: ErrorHandler, on_unexpected: ErrorHandler) -> None:
        self.app, self.on_proxy_error, self.on_unexpected = app, on_proxy_error, on_unexpected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self.app  # what Starlette sets for its routes (request.app)
        request = Request(scope, receive, send)
        try:
            response = await self.app.state.dispatcher.handle(request, scope["path"])
        except ProxyError as exc:
            response = await self.on_proxy_error(request, exc)
        except Exception as exc:  # noqa: BLE001 - a bug: the client gets the error body, the log the traceback
            response = await self.on_unexpected(request, exc)
        await response(scope, receive, send)


class RelayFront:
    """Sends relay POSTs to ``relay`` (the guarded RelayRoutes), everything else to ``rest``."""

    def __init__(self, rest: ASGIApp, relay: ASGIApp) -> None:
        self.rest, self.relay = rest, relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in RELAY_PATHS
                and not scope.get("root_path")):
            await self.relay(scope, receive, send)
        else:
            await self.rest(scope, receive, send)


def serve_relay_first(app: Starlette, relay: ASGIApp) -> None:
    """Put RelayFront around ``app``'s middleware stack (call before ``bound_writes``)."""
    build = app.build_middleware_stack
    app.build_middleware_stack = lambda: RelayFront(build(), relay)  # type: ignore[method-assign]
