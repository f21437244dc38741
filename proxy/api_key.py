"""``--api-key``: clients prove they may use the proxy before it reads a byte of their body.

An ASGI middleware, outermost on the proxy's app: a request to an OpenAI route (``/v1/...``)
or to ``/metrics`` (it names the cluster's internal node addresses) must carry
``Authorization: Bearer <key>``; anything else gets a 401 with an OpenAI error body at once,
before the body limits read up to ``--max-request-bytes``. The scheme is matched without
regard to case (RFC 9110 §11.1: ``bearer`` is ``Bearer``); the key is compared in constant
time. ``/health`` and ``/ready`` stay open for load balancers and orchestrators.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from common.serving.limits import error_response_messages

_GUARDED_PREFIXES = ("/v1/", "/metrics")


def bearer_token(header: bytes) -> bytes | None:
    """The credentials of an ``Authorization: Bearer <token>`` header (any case of the scheme)."""
    scheme, _, token = header.strip().partition(b" ")
    if scheme.lower() != b"bearer":
        return None
    return token.strip() or None


class ApiKeyOnly:
    """Refuses guarded paths without the right bearer key (401) before anything reads the body."""

    def __init__(self, app: ASGIApp, api_key: str, on_refused: Callable[[], None] = lambda: None) -> None:
        self.app, self.expected, self.on_refused = app, api_key.encode(), on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_GUARDED_PREFIXES) and not self._allowed(scope):
            self.on_refused()
            headers = dict(scope["headers"])
            request_id = headers.get(b"x-request-id", b"").decode("latin-1")[:1024] or None
            message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
            for event in error_response_messages(401, message, None, "invalid_api_key", request_id):
                await send(event)
            return
        await self.app(scope, receive, send)

    def _allowed(self, scope: Scope) -> bool:
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        token = bearer_token(given)
        return token is not None and hmac.compare_digest(token, self.expected)
