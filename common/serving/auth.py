"""Signed request ids: with a cluster key, a daemon serves only what the proxy sent.

An ASGI middleware, outermost on the prefill and decode daemons' apps: every POST
(the OpenAI routes) needs an ``X-Request-Id`` with the proxy's ``X-PDServe-Signature``
over it for this daemon's role (see common.cluster_auth), unexpired and not seen before,
and the id must name this daemon's own KV address for its role (a leg signed for one
node is no good at another). Anything else gets a 403 with an OpenAI error body before
the body is read, the id is parsed, a block is allocated or a socket is opened. Then the
body is read (at most ``max_bytes``) and must have the digest the signature names (403
otherwise): a signed id cannot carry another body. The proxy's ``--api-key`` cannot be
bypassed by calling a daemon directly. GETs (health, readiness, metrics, models) stay open; ``/admin/``
routes check a signature made for the ``admin`` role themselves (common/node/role_routes.py).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from common.cluster_auth import ID_TTL_S, SIGNATURE_HEADER, ClusterKey, ReplayWindow
from common.request_id import parse_tags
from common.serving.errors import OpenAIError
from common.serving.limits import DEFAULT_MAX_REQUEST_BYTES, error_response_messages, replay_body

logger = logging.getLogger(__name__)
_ID, _SIG = b"x-request-id", SIGNATURE_HEADER.lower().encode()
ADMIN_PATH_PREFIX = "/admin/"


class SignedIdsOnly:
    """Refuses POSTs whose request id the cluster's proxy did not sign (403)."""

    def __init__(self, app: ASGIApp, key: ClusterKey, role: str | Callable[[], str], kv_addr: str,
                 max_bytes: int = DEFAULT_MAX_REQUEST_BYTES, unsigned_kv_params: bool = False) -> None:
        self.app, self.key, self.kv_addr, self.max_bytes = app, key, kv_addr, max_bytes
        # the node's role now: a callable on a daemon whose role may flip (common/node/role_flip.py)
        self._role = role if callable(role) else (lambda: role)
        self.unsigned_kv_params = unsigned_kv_params  # --accept-unsigned-kv-transfer-params
        self._seen = ReplayWindow(2 * ID_TTL_S)  # covers a signature's whole life, clock skew included

    @property
    def role(self) -> str:
        return self._role()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        # admin routes check their own signature, made for the admin role (common/node/role_routes.py)
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"].startswith(ADMIN_PATH_PREFIX):
            await self.app(scope, receive, send)
            return
        request_id, signature = _headers(scope)
        reason = self.refusal(request_id, signature)
        # kv_transfer_params' routers sign nothing: with --accept-unsigned-kv-transfer-params an untagged id
        # may carry them (kv_params.py checks them)
        if reason is None or (self.unsigned_kv_params and signature is None and parse_tags(request_id) is None):
            body = await _read_body(receive, self.max_bytes)
            if body is None:
                return  # the client left
            if len(body) > self.max_bytes:
                for message in error_response_messages(413, f"the request body is larger than this server's "
                                                       f"limit of {self.max_bytes} bytes (--max-request-bytes)",
                                                       "body", "request_too_large", request_id):
                    await send(message)
                return
            if reason is None and hashlib.sha256(body).hexdigest() != self.key.signed_body_digest(signature or ""):
                reason = "the body is not the one the request id was signed with"
            elif reason is None or _asks_kv_params(body, self.role):
                await self.app(scope, replay_body(body, receive), send)
                return
        logger.warning("refused %s: %s", scope.get("path"), reason)
        error = OpenAIError(f"forbidden: {reason}; send requests through this cluster's proxy",
                            status=403, type="permission_error", param="X-Request-Id",
                            code="unsigned_request_id")
        await error.response()(scope, receive, send)

    def refusal(self, request_id: str | None, signature: str | None) -> str | None:
        """Why a request with these headers may not be served, or None (its body still to check)."""
        if not request_id:
            return "missing X-Request-Id"
        reason = self.key.check_id(request_id, signature, self.role)
        if reason is None and self._own_addr(request_id) != self.kv_addr:
            reason = f"the request id names another {self.role} node, not this one ({self.kv_addr})"
        if reason is None and signature and not self._seen.first_time(signature.encode("latin-1")):
            reason = "request id signature already used"
        return reason

    def _own_addr(self, request_id: str) -> str | None:
        tags = parse_tags(request_id)
        if tags is None:
            return None
        return tags.prefill_addr if self.role == "prefill" else tags.decode_addr


def _asks_kv_params(body: bytes, role: str) -> bool:
    """Does ``body`` take the ``kv_transfer_params`` path on a ``role`` node (its flag is true)?"""
    flag = {"prefill": "do_remote_decode", "decode": "do_remote_prefill"}.get(role)
    try:
        params = json.loads(body).get("kv_transfer_params")
    except (ValueError, AttributeError):
        return False
    return flag is not None and isinstance(params, dict) and params.get(flag) is True


def _headers(scope: Scope) -> tuple[str | None, str | None]:
    request_id = signature = None
    for name, value in scope["headers"]:
        if name == _ID and request_id is None:
            request_id = value.decode("latin-1")
        elif name == _SIG and signature is None:
            signature = value.decode("latin-1")
    return request_id, signature


async def _read_body(receive: Receive, max_bytes: int) -> bytes | None:
    """The whole body (cut short just past ``max_bytes``), or None when the client left."""
    body = bytearray()
    more = True
    while more:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        body += message.get("body", b"")
        if len(body) > max_bytes:
            return None
        more = message.get("more_body", False)
    return bytes(body)
