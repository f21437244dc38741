"""The pooled transport reuses connections and survives a node that closed them; phase timeouts."""

from __future__ import annotations

import asyncio
import json

import httpx
from proxy_fakes import FakeNode, ServerThread

from helpers.waiting import wait_for
from proxy.transport import PooledTransport

BODY = {"model": "m", "prompt": "hi"}


async def _post(transport: PooledTransport, port: int) -> int:
    resp = await transport.post(f"127.0.0.1:{port}", "/v1/completions", json.dumps(BODY).encode(), [])
    await resp.aread()
    return resp.status_code


def test_connections_are_reused_and_a_restarted_node_is_reconnected():
    node = FakeNode("D")
    with ServerThread(node.app) as server:
        port = server.port

        async def first_round(transport: PooledTransport) -> None:
            for _ in range(10):
                assert await _post(transport, port) == 200

        async def run() -> None:
            async with PooledTransport() as transport:
                await first_round(transport)
                assert len({s.client_port for s in node.seen}) == 1  # one keep-alive connection
                server.__exit__(None, None, None)  # the node goes away with our idle socket open
                with ServerThread(node.app, port=port):
                    assert await _post(transport, port) == 200

        asyncio.run(run())
    assert len({s.client_port for s in node.seen}) == 2


def test_prefill_timeout_is_504_and_cancels_decode(make_cluster):
    c = make_cluster(prefill_timeout_s=0.3)
    c.prefills[0].behavior.delay_s = 3.0
    c.decodes[0].behavior.delay_s = 3.0
    r = httpx.post(f"{c.url}/v1/completions", json=BODY, timeout=10)
    assert r.status_code == 504 and "prefill timeout" in r.json()["error"]["message"]
    assert wait_for(lambda: c.decodes[0].seen and c.decodes[0].seen[0].cancelled, timeout=3)


def test_first_token_timeout_on_a_stream_is_504(make_cluster):
    c = make_cluster(first_token_timeout_s=0.3)
    c.decodes[0].behavior.delay_s = 3.0
    r = httpx.post(f"{c.url}/v1/completions", json={**BODY, "stream": True}, timeout=10)
    assert r.status_code == 504
    assert wait_for(lambda: c.decodes[0].seen and c.decodes[0].seen[0].cancelled, timeout=3)


def test_total_timeout_mid_stream_ends_with_an_sse_error(make_cluster):
    c = make_cluster(total_timeout_s=0.5)
    c.decodes[0].behavior.chunk_delay_s = 0.4  # the whole answer would take 1.6 s
    with httpx.stream("POST", f"{c.url}/v1/completions", json={**BODY, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert '"code":"timeout"' in text and text.endswith("data: [DONE]\n\n")
    assert wait_for(lambda: c.decodes[0].seen[0].cancelled, timeout=3)
