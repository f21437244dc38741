"""The two HTTP legs of a request: prefill (one token, non-stream) and decode (the answer).

Both go through the app's single pooled ``httpx.AsyncClient``. Every transport
failure, timeout and error status becomes a ProxyError naming the node and the
phase, so the dispatcher only ever sees one kind of failure.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx

from common.registry_client import RegistrationMessage
from proxy.config import ProxyConfig
from proxy.errors import UpstreamError, UpstreamTimeout, UpstreamUnreachable
from proxy.metrics import ProxyMetrics


def prefill_body(body: dict, path: str) -> bytes:
    """The client's body made into a one-token, non-stream prefill request."""
    out = dict(body)
    out["max_tokens"] = 1
    if path.endswith("/chat/completions"):
        out["max_completion_tokens"] = 1
    out["stream"] = False
    out.pop("stream_options", None)
    return json.dumps(out, separators=(",", ":")).encode()


class Legs:
    """Sends legs to nodes through the app's one pooled transport.

    The transport is called directly rather than through ``httpx.AsyncClient``: the
    client layer (cookie jar, auth and redirect machinery, header merging) was about a
    fifth of the proxy's CPU per request and does nothing for a hop to our own nodes.
    """

    def __init__(self, transport: httpx.AsyncBaseTransport, config: ProxyConfig, metrics: ProxyMetrics):
        self.transport = transport
        self.config = config
        self.metrics = metrics
        # httpx reads phase timeouts from here; only connect is httpx's, the rest are per leg (_guard).
        self._extensions = {"timeout": {"connect": config.connect_timeout_s, "read": None, "write": None,
                                        "pool": None}}

    def _request(self, node: RegistrationMessage, path: str, body: bytes, request_id: str) -> httpx.Request:
        headers = [(b"host", node.http_address.encode()), (b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"x-request-id", request_id.encode())]
        return httpx.Request("POST", f"http://{node.http_address}{path}", headers=headers, content=body,
                             extensions=self._extensions)

    async def _send(self, request: httpx.Request, stream: bool = False) -> httpx.Response:
        resp = await self.transport.handle_async_request(request)
        if not stream:
            try:
                await resp.aread()
            finally:
                await resp.aclose()
        return resp

    async def prefill(self, node: RegistrationMessage, path: str, body: bytes, request_id: str) -> None:
        """Run the prefill leg to its end; raises a ProxyError when it did not succeed."""
        self.metrics.count_leg("prefill", node.http_address)
        async with _guard("prefill", node.http_address, "prefill", self.config.prefill_timeout_s):
            resp = await self._send(self._request(node, path, body, request_id))
        if resp.status_code >= 400:
            raise UpstreamError("prefill", node.http_address, resp.status_code, resp.content)

    async def decode_open(self, node: RegistrationMessage, path: str, body: bytes, request_id: str) -> httpx.Response:
        """Open the decode leg as a stream; its status is checked, its body not yet read."""
        self.metrics.count_leg("decode", node.http_address)
        # The first-token deadline is the dispatcher's (it spans these headers and the first bytes).
        async with _guard("decode", node.http_address, "total", self.config.total_timeout_s):
            resp = await self._send(self._request(node, path, body, request_id), stream=True)
            if resp.status_code >= 400:
                try:
                    content = await resp.aread()
                finally:
                    await resp.aclose()
                raise UpstreamError("decode", node.http_address, resp.status_code, content)
        return resp

    async def decode_full(self, node: RegistrationMessage, path: str, body: bytes, request_id: str) -> httpx.Response:
        """Run a non-stream decode leg; a 200 with an empty body counts as a failure."""
        self.metrics.count_leg("decode", node.http_address)
        async with _guard("decode", node.http_address, "total", self.config.total_timeout_s):
            resp = await self._send(self._request(node, path, body, request_id))
        if resp.status_code >= 400:
            raise UpstreamError("decode", node.http_address, resp.status_code, resp.content)
        if not resp.content:
            raise UpstreamUnreachable("decode", node.http_address, f"empty {resp.status_code} answer")
        return resp


async def read_chunks(resp: httpx.Response, node: str) -> AsyncIterator[bytes]:
    """The decode node's bytes as they arrive (raw: never decoded, so relayed byte-identical)."""
    try:
        async for chunk in resp.aiter_raw():
            if chunk:
                yield chunk
    except httpx.TransportError as exc:
        raise UpstreamUnreachable("decode", node, f"stream broke: {type(exc).__name__}: {exc}") from exc


@asynccontextmanager
async def _guard(role: str, node: str, phase: str, seconds: float) -> AsyncIterator[None]:
    try:
        async with asyncio.timeout(seconds):
            yield
    except httpx.ConnectTimeout as exc:  # a node that cannot be reached: retryable, unlike a slow one
        raise UpstreamUnreachable(role, node, f"connect timeout: {exc}") from exc
    except (TimeoutError, httpx.TimeoutException) as exc:
        raise UpstreamTimeout(role, node, phase, seconds) from exc
    except httpx.TransportError as exc:
        raise UpstreamUnreachable(role, node, f"{type(exc).__name__}: {exc}") from exc
