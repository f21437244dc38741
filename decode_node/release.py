"""Release the prefill node's KV for tagged requests the decode node refuses.

The proxy's prefill leg runs with ``max_tokens: 1``, so a body the decode node rejects
(bad ``max_tokens``, prompt too long for this node…) may still have been prefilled; the
prefill node would hold that KV until its lease ends. An ASGI middleware (not Starlette's
BaseHTTPMiddleware, which would buffer and re-wrap every streamed response) watches the
status and, on a 4xx for a tagged id, tells the prefill node to drop the request (for
``kv_transfer_params``, once the serving layer verified them: the transfer id and prefill node
they name; never for params refused as forged, expired or spent). The same
holds for the 499 a non-streaming reply ends with when the proxy hangs up (it gave up on the
request: a prefill timeout, the client gone): nobody will ask for that KV either.

A refused id must cost nothing: with a cluster key the signature check sits outside this
middleware, so an unsigned id is refused (403) before it gets here and no connection is
opened for it; without a key the id is unverified, and ``release`` opens a connection only
to a prefill node that ``--kv-peers`` or the registry's member list names (to any other it uses
one already open, see decode_node.daemon).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.request_id import parse_tags

logger = logging.getLogger(__name__)
CLIENT_CLOSED = 499  # what a non-streaming reply ends with when the caller hung up (never sent)


class ReleaseRefusedKV:
    def __init__(self, app: ASGIApp, release: Callable[[str, str], None]) -> None:
        self.app, self.release = app, release

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return

        async def watch(message: Message) -> None:
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                self._release(scope, message["status"])
            await send(message)

        scope.setdefault("state", {})  # shared with the request inside, even through a copied scope
        await self.app(scope, receive, watch)

    def _release(self, scope: Scope, status: int) -> None:
        request_id = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"x-request-id"), None)
        tags = parse_tags(request_id)
        # kv_transfer_params the serving layer verified: the transfer id and prefill node they name
        via_params = scope.get("state", {}).get("pdserve_kv_release")
        if via_params is not None:
            request_id, prefill_addr = via_params
        elif tags is None or request_id is None or tags.local_prefill:  # a local prefill left no KV anywhere
            return
        else:
            prefill_addr = tags.prefill_addr
        why = "the proxy gave up on it" if status == CLIENT_CLOSED else f"refused here ({status})"
        logger.info("request %s %s: telling %s to drop its KV", request_id, why, prefill_addr)
        self.release(request_id, prefill_addr)
