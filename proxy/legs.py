"""The two HTTP legs of a request: prefill (one token, non-stream) and decode (the answer).

Both go through the app's single pooled transport (proxy/transport.py). Every transport
failure, timeout and error status becomes a ProxyError naming the node and the
phase, so the dispatcher only ever sees one kind of failure.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from common.cluster_auth import SIGNATURE_HEADER, ClusterKey
from common.registry_client import RegistrationMessage
from common.serving.resume import TOKEN_IDS_HEADER
from proxy.config import ProxyConfig
from proxy.errors import UpstreamError, UpstreamTimeout, UpstreamUnreachable
from proxy.http_client import ConnectError, ConnectTimeout, TransportError
from proxy.metrics import ProxyMetrics
from proxy.transport import PooledTransport, Response


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
    """Sends legs to nodes through the app's one pooled transport."""

    def __init__(self, transport: PooledTransport, config: ProxyConfig, metrics: ProxyMetrics,
                 unreachable: Callable[[str, str], None] = lambda role, node: None):
        self.transport = transport
        self.config = config
        self.metrics = metrics
        self.unreachable = unreachable  # told (role, node) when a leg cannot reach its node
        self.key = ClusterKey.optional(config.cluster_key_file)  # signs each tagged id it sends

    def _headers(self, request_id: str, role: str, body: bytes) -> list[tuple[str, str]]:
        headers = [("x-request-id", request_id)]
        if self.key is not None:  # good for this leg only: its role and its exact body
            headers.append((SIGNATURE_HEADER.lower(), self.key.sign_id(request_id, role, body)))
        return headers

    async def _send(self, role: str, node: RegistrationMessage, path: str, body: bytes, request_id: str,
                    stream: bool = False) -> Response:
        headers = self._headers(request_id, role, body)
        if stream:  # a decode stream: the ids behind each event, so the stream can be resumed (migration.py)
            headers.append((TOKEN_IDS_HEADER, "1"))
        resp = await self.transport.post(node.http_address, path, body, headers)
        if not stream:
            await resp.aread()
        return resp

    async def prefill(self, node: RegistrationMessage, path: str, body: bytes, request_id: str) -> None:
        """Run the prefill leg to its end; raises a ProxyError when it did not succeed."""
        self.metrics.count_leg("prefill", node.http_address)
        async with _guard("prefill", node.http_address, "prefill", self.config.prefill_timeout_s,
                          self.unreachable):
            resp = await self._send("prefill", node, path, body, request_id)
        if resp.status_code >= 400:
            raise UpstreamError("prefill", node.http_address, resp.status_code, resp.content)

    async def decode_open(self, node: RegistrationMessage, path: str, body: bytes, request_id: str) -> Response:
        """Open the decode leg as a stream; its status is checked, its body not yet read."""
        self.metrics.count_leg("decode", node.http_address)
        # The first-token deadline is the dispatcher's (it spans these headers and the first bytes).
        async with _guard("decode", node.http_address, "total", self.config.total_timeout_s, self.unreachable):
            resp = await self._send("decode", node, path, body, request_id, stream=True)
            if resp.status_code >= 400:
                try:
                    content = await resp.aread()
                finally:
                    await resp.aclose()
                raise UpstreamError("decode", node.http_address, resp.status_code, content)
        return resp

    async def decode_full(self, node: RegistrationMessage, path: str, body: bytes, request_id: str) -> Response:
        """Run a non-stream decode leg; a 200 with an empty body counts as a failure."""
        self.metrics.count_leg("decode", node.http_address)
        async with _guard("decode", node.http_address, "total", self.config.total_timeout_s, self.unreachable):
            resp = await self._send("decode", node, path, body, request_id)
        if resp.status_code >= 400:
            raise UpstreamError("decode", node.http_address, resp.status_code, resp.content)
        if not resp.content:
            raise UpstreamUnreachable("decode", node.http_address, f"empty {resp.status_code} answer")
        return resp


async def read_chunks(resp: Response, node: str) -> AsyncIterator[bytes]:
    """The decode node's bytes as they arrive (raw: never decoded, so relayed byte-identical)."""
    try:
        async for chunk in resp.aiter_raw():
            if chunk:
                yield chunk
    except TransportError as exc:
        raise UpstreamUnreachable("decode", node, f"stream broke: {type(exc).__name__}: {exc}") from exc


@asynccontextmanager
async def _guard(role: str, node: str, phase: str, seconds: float,
                 unreachable: Callable[[str, str], None]) -> AsyncIterator[None]:
    try:
        async with asyncio.timeout(seconds):
            yield
    except ConnectTimeout as exc:  # a node that cannot be reached: retryable, unlike a slow one
        unreachable(role, node)
        raise UpstreamUnreachable(role, node, f"connect timeout: {exc}", reached=False) from exc
    except TimeoutError as exc:
        raise UpstreamTimeout(role, node, phase, seconds) from exc
    except TransportError as exc:  # refused, reset: the node is down or going
        unreachable(role, node)
        raise UpstreamUnreachable(role, node, f"{type(exc).__name__}: {exc}",
                                  reached=not isinstance(exc, ConnectError)) from exc
