"""Signed request ids: with a cluster key, a daemon serves only what the proxy sent.

An ASGI middleware, outermost on the prefill and decode daemons' apps: every POST
(the OpenAI routes) needs an ``X-Request-Id`` with the proxy's ``X-PDServe-Signature``
over it (see common.cluster_auth), unexpired and not seen before. Anything else gets a
403 with an OpenAI error body before the body is read, the id is parsed, a block is
allocated or a socket is opened; the proxy's ``--api-key`` cannot be bypassed by
calling a daemon directly. GETs (health, readiness, metrics, models) stay open.
"""

from __future__ import annotations

import logging

from starlette.types import ASGIApp, Receive, Scope, Send

from common.cluster_auth import ID_TTL_S, SIGNATURE_HEADER, ClusterKey, ReplayWindow
from common.serving.errors import OpenAIError

logger = logging.getLogger(__name__)
_ID, _SIG = b"x-request-id", SIGNATURE_HEADER.lower().encode()


class SignedIdsOnly:
    """Refuses POSTs whose request id the cluster's proxy did not sign (403)."""

    def __init__(self, app: ASGIApp, key: ClusterKey) -> None:
        self.app, self.key = app, key
        self._seen = ReplayWindow(2 * ID_TTL_S)  # covers a signature's whole life, clock skew included

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            reason = self.refusal(scope)
            if reason is not None:
                logger.warning("refused %s: %s", scope.get("path"), reason)
                error = OpenAIError(f"forbidden: {reason}; send requests through this cluster's proxy",
                                    status=403, type="permission_error", param="X-Request-Id",
                                    code="unsigned_request_id")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> str | None:
        """Why this request may not be served, or None."""
        request_id = signature = None
        for name, value in scope["headers"]:
            if name == _ID and request_id is None:
                request_id = value.decode("latin-1")
            elif name == _SIG and signature is None:
                signature = value.decode("latin-1")
        if not request_id:
            return "missing X-Request-Id"
        reason = self.key.check_id(request_id, signature)
        if reason is None and signature and not self._seen.first_time(signature.encode("latin-1")):
            reason = "request id signature already used"
        return reason
