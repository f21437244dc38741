"""The two relay routes (POST /v1/completions, /v1/chat/completions) served without FastAPI's router.

Every client request the proxy relays goes through here, so its per-request cost is the
proxy's throughput: FastAPI's routing, dependency solving and per-route exception wrapping
cost about a fifth of the proxy's CPU per request (bench/proxy_overhead.py, py-spy), and the
relay routes need none of it: they take the raw ``Request`` and return a ``Response``. This
ASGI layer sits inside ``ApiKeyOnly`` and ``BodyLimits`` (a request reaches it keyed and
bounded), answers the two routes itself, and hands every other request (another path, another
method: 405 as before) to the app's router. Errors get the app's own OpenAI error bodies.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.errors import ProxyError

RELAY_PATHS = ("/v1/completions", "/v1/chat/completions")
ErrorHandler = Callable[[Request, Exception], Awaitable[Response]]


class RelayRoutes:
    """Serves the relay routes with ``app.state.dispatcher``; everything else goes on to ``app``."""

    def __init__(self, app: ASGIApp, on_proxy_error: ErrorHandler, on_unexpected: ErrorHandler) -> None:
        self.app, self.on_proxy_error, self.on_unexpected = app, on_proxy_error, on_unexpected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path")
        if scope["type"] != "http" or scope["method"] != "POST" or path not in RELAY_PATHS or scope.get("root_path"):
            await self.app(scope, receive, send)
            return
        request = Request(scope, receive, send)
        try:
            response = await scope["app"].state.dispatcher.handle(request, path)
        except ProxyError as exc:
            response = await self.on_proxy_error(request, exc)
        except Exception as exc:  # a bug: the client gets the error body, the log the traceback
            response = await self.on_unexpected(request, exc)
        await response(scope, receive, send)
