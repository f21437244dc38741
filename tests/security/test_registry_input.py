"""Attacks on the registry port (issue 11, "what was seen" 1 and 2): whatever arrives, the
listener lives, bad messages are dropped and counted, nothing malformed is routed to, and
a good node registered afterwards takes traffic. Real ZMQ sockets against a real proxy."""

from __future__ import annotations

import random

import httpx
import msgpack
import pytest
import zmq
from proxy_fakes import FakeNode, ServerThread

from common.registry_client import Heartbeater
from helpers.waiting import wait_for
from proxy.app import build_app
from proxy.config import ProxyConfig
from proxy.registry import ServiceRegistry

GOOD = {"type": "P", "http_address": "127.0.0.1:1", "zmq_address": "127.0.0.1:2", "model": "m"}
TYPED_WRONG = [
    {**GOOD, "heartbeat_interval_s": "fast"},
    {**GOOD, "model": 12345},
    {**GOOD, "heartbeat_interval_s": 1e9},
    {**GOOD, "num_running": -1},
    {**GOOD, "num_free_blocks": 2**63},
    {**GOOD, "type": "X"},
    {**GOOD, "http_address": "no-port"},
    {**GOOD, "http_address": "h:99999"},
    {**GOOD, "zmq_address": ["a", 1]},
    {**GOOD, "model": "m" * 5000},
    {**GOOD, "goodbye": "yes"},
    {"type": "P"},
    [GOOD],
    "P",
    12,
    None,
]


class Dealers:
    """Raw DEALER sockets, each its own sender to the registry."""

    def __init__(self, address: str) -> None:
        self.address, self.ctx, self.socks = address, zmq.Context(), []

    def new(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://{self.address}")
        self.socks.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.ctx.term()


@pytest.fixture
def proxy_with_nodes():
    p, d = FakeNode("P", "p0"), FakeNode("D", "d0")
    registry = ServiceRegistry(port=0, heartbeat_timeout_s=30, sweep_interval_s=0.05, rate_per_s=100_000)
    app = build_app(ProxyConfig(port=0, registry_port=0), registry)
    with ServerThread(p.app) as p_srv, ServerThread(d.app) as d_srv, ServerThread(app) as proxy:
        dealers = Dealers(registry.address)
        try:
            yield registry, proxy, dealers, p_srv.address, d_srv.address
        finally:
            dealers.close()


def test_fuzzed_registry_keeps_listening_and_routes_a_good_node(proxy_with_nodes):
    registry, proxy, dealers, p_addr, d_addr = proxy_with_nodes
    rng = random.Random(11)
    fuzz = dealers.new()
    sent = 0
    for _ in range(300):
        fuzz.send(rng.randbytes(rng.randint(0, 600)))
        sent += 1
    for msg in TYPED_WRONG:
        fuzz.send(msgpack.packb(msg))
        fuzz.send_multipart([msgpack.packb(GOOD), b"extra", b"frames"])  # keyless: one frame only
        sent += 2
    huge = dealers.new()  # 50 MB address: libzmq closes this connection before buffering it
    huge.send(msgpack.packb({**GOOD, "http_address": "a" * (50 << 20) + ":1"}))
    assert wait_for(lambda: sum(registry.rejected().values()) >= sent, timeout=20)
    assert registry.counts() == {"P": 0, "D": 0}
    assert registry._thread is not None and registry._thread.is_alive()
    r = httpx.get(f"{proxy.url}/v1/models")
    assert r.status_code == 200 and r.json()["data"] == []

    good = dealers.new()
    good.send(msgpack.packb({"type": "P", "http_address": p_addr, "zmq_address": "127.0.0.1:14579",
                             "model": "m", "kv_fingerprint": "f"}))
    good.send(msgpack.packb({"type": "D", "http_address": d_addr, "zmq_address": "127.0.0.1:14580",
                             "model": "m", "kv_fingerprint": "f"}))
    assert wait_for(lambda: httpx.get(f"{proxy.url}/ready").status_code == 200, timeout=10)
    r = httpx.post(f"{proxy.url}/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 200 and r.json()["node"] == "d0"
    assert [m["id"] for m in httpx.get(f"{proxy.url}/v1/models").json()["data"]] == ["m"]
    metrics = httpx.get(f"{proxy.url}/metrics").text
    assert 'pdserve:proxy_registry_rejected_total{reason="invalid",role="proxy"}' in metrics


def _node(i: int) -> bytes:
    return msgpack.packb({"type": "D", "http_address": f"127.0.0.1:{1000 + i}", "zmq_address": "127.0.0.1:9",
                          "model": "m", "kv_fingerprint": "f"})


def test_max_nodes_and_per_sender_rate_limit():
    registry = ServiceRegistry(port=0, max_nodes=50, rate_per_s=5.0, heartbeat_timeout_s=60)
    registry.start()
    dealers = Dealers(registry.address)
    try:
        for i in range(200):  # one sender per 5 messages: within its rate
            if i % 5 == 0:
                sock = dealers.new()
            sock.send(_node(i))
        assert wait_for(lambda: registry.rejected().get("full", 0) == 150, timeout=20)
        assert registry.counts() == {"P": 0, "D": 50}
        flood = dealers.new()
        for _ in range(500):
            flood.send(_node(0))  # a registered node's heartbeat, far too often
        assert wait_for(lambda: registry.rejected().get("rate_limited", 0) > 0, timeout=20)
        assert registry.counts() == {"P": 0, "D": 50}
    finally:
        dealers.close()
        registry.stop()


def test_graceful_stop_says_goodbye():
    """The node leaves the table at once, long before its heartbeat timeout would evict it."""
    registry = ServiceRegistry(port=0, heartbeat_timeout_s=120, sweep_interval_s=0.05)
    registry.start()
    beat = Heartbeater(registry.address, lambda: {"type": "D", "http_address": "127.0.0.1:9",
                                                  "zmq_address": "127.0.0.1:10"}, interval_s=0.2)
    try:
        beat.start()
        assert wait_for(lambda: registry.counts()["D"] == 1)
        beat.stop()
        assert wait_for(lambda: registry.counts()["D"] == 0, timeout=5)
    finally:
        beat.stop()
        registry.stop()


def test_a_flood_of_registrations_cannot_crowd_out_routing(proxy_with_nodes):
    """5,000 fake nodes (each its own KV fingerprint) on top of a real pair: the table stops at
    --max-nodes, the rest are refused, and requests still go to the real pair."""
    registry, proxy, dealers, p_addr, d_addr = proxy_with_nodes
    good = dealers.new()
    for kind, addr in (("P", p_addr), ("D", d_addr)):
        good.send(msgpack.packb({"type": kind, "http_address": addr, "zmq_address": "127.0.0.1:14579",
                                 "model": "m", "kv_fingerprint": "f"}))
    assert wait_for(lambda: registry.counts() == {"P": 1, "D": 1})
    flood = dealers.new()
    for i in range(5000):
        flood.send(msgpack.packb({"type": "PD"[i % 2], "http_address": f"127.0.0.1:{20000 + i}",
                                  "zmq_address": "127.0.0.1:81", "model": "m", "kv_fingerprint": f"fp{i}"}))
    assert wait_for(lambda: registry.rejected().get("full", 0) == 5000 - (registry.max_nodes - 2), timeout=30)
    assert sum(registry.counts().values()) == registry.max_nodes
    for _ in range(20):
        r = httpx.post(f"{proxy.url}/v1/completions", json={"model": "m", "prompt": "hi"})
        assert r.status_code == 200 and r.json()["node"] == "d0"
