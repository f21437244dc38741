"""Ops routes and registration end to end: 503 with no nodes, /ready, /v1/models, /metrics."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from proxy_fakes import FakeNode, ServerThread

from common.registry_client import Heartbeater
from helpers.waiting import wait_for
from proxy.app import build_app
from proxy.config import ProxyConfig

BODY = {"model": "m", "prompt": "hi"}


def test_no_nodes_is_503_and_not_ready():
    app = build_app(ProxyConfig(port=0, registry_port=0))
    with ServerThread(app) as proxy:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = httpx.post(f"{proxy.url}{path}", json=BODY)
            assert r.status_code == 503
            assert r.json()["error"]["message"] == "no prefill node is registered"
        assert httpx.get(f"{proxy.url}/ready").status_code == 503
        assert httpx.get(f"{proxy.url}/health").status_code == 200
        metrics = httpx.get(f"{proxy.url}/metrics").text
        assert 'pdserve:proxy_requests_total{role="proxy",status="503"} 2.0' in metrics
        assert 'pdserve:proxy_errors_total{kind="no_node",role="proxy"} 2.0' in metrics


def test_nodes_registered_over_zmq_serve_requests():
    """Our Heartbeater (D) and a vLLM-format sender (P) register; requests flow; eviction unreadies."""
    p, d = FakeNode("P", "p0"), FakeNode("D", "d0")
    d.behavior.after = (p,)  # as a real decode node, answer only once the prefill node has the request
    config = ProxyConfig(port=0, registry_port=0, heartbeat_timeout_s=0.5, sweep_interval_s=0.05)
    app = build_app(config)
    with ServerThread(p.app) as p_srv, ServerThread(d.app) as d_srv, ServerThread(app) as proxy:
        registry_addr = app.state.registry.address
        beat = Heartbeater(registry_addr, lambda: {"type": "D", "http_address": d_srv.address,
                                                   "zmq_address": "127.0.0.1:14580"}, interval_s=0.1)
        ctx = zmq.Context()
        vllm = ctx.socket(zmq.DEALER)
        vllm.setsockopt(zmq.LINGER, 0)
        vllm.connect(f"tcp://{registry_addr}")
        beat.start()
        try:
            vllm.send(msgpack.packb({"type": "P", "http_address": p_srv.address, "zmq_address": "127.0.0.1:14579"}))
            assert wait_for(lambda: httpx.get(f"{proxy.url}/ready").status_code == 200)
            r = httpx.post(f"{proxy.url}/v1/completions", json=BODY)
            assert r.status_code == 200 and r.json()["node"] == "d0"
            assert p.seen[0].request_id.startswith("___prefill_addr_127.0.0.1:14579___decode_addr_127.0.0.1:14580_")
            metrics = httpx.get(f"{proxy.url}/metrics").text
            assert 'pdserve:registered_nodes{role="proxy",type="D"} 1.0' in metrics
            assert f'pdserve:proxy_node_requests_total{{node="{p_srv.address}",role="prefill"}} 1.0' in metrics
            assert "pdserve:proxy_request_latency_seconds_count" in metrics
            # The vLLM-format P stops beating: the sweep evicts it, the proxy is not ready any more.
            assert wait_for(lambda: httpx.get(f"{proxy.url}/ready").status_code == 503, timeout=3)
            assert app.state.registry.counts() == {"P": 0, "D": 1}  # D keeps beating
        finally:
            beat.stop()
            vllm.close()
            ctx.term()


def test_models_lists_registered_models(make_cluster):
    c = make_cluster()
    r = httpx.get(f"{c.url}/v1/models")
    assert r.status_code == 200
    assert [m["id"] for m in r.json()["data"]] == ["m"]


def test_streaming_ttft_is_observed(make_cluster):
    c = make_cluster()
    with httpx.stream("POST", f"{c.url}/v1/completions", json={**BODY, "stream": True}) as r:
        r.read()
    metrics = httpx.get(f"{c.url}/metrics").text
    assert 'pdserve:time_to_first_token_seconds_count{role="proxy"} 1.0' in metrics


def test_python_m_proxy_serves_and_rejects_bad_flags():
    import subprocess
    import sys

    from helpers import zygote
    from helpers.ports import free_port

    root = Path(__file__).resolve().parents[2]
    bad = zygote.run([sys.executable, "-m", "proxy", "--policy", "random"], timeout=30, cwd=root)
    assert bad.returncode == 2 and "--policy" in bad.stderr
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "proxy", "--port", str(port), "--registry-port", "0"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root)
    try:
        assert wait_for(lambda: _get_ok(f"http://127.0.0.1:{port}/health"), timeout=20, step=0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _get_ok(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.parametrize("stream", [False, True])
def test_a_leg_whose_node_is_evicted_fails_instead_of_waiting_out_its_timeout(stream):
    """A stopped decode node: the proxy evicts it after missed heartbeats, and the request it
    holds fails then (502 naming it), not after the minutes-long total / first-token timeout."""
    p, d = FakeNode("P", "p0"), FakeNode("D", "d0")
    config = ProxyConfig(port=0, registry_port=0, heartbeat_timeout_s=0.5, sweep_interval_s=0.05)
    app = build_app(config)
    with ServerThread(p.app) as p_srv, ServerThread(d.app) as d_srv, ServerThread(app) as proxy:
        def beat(srv: ServerThread, node_type: str, kv_port: int) -> Heartbeater:
            message = {"type": node_type, "http_address": srv.address, "zmq_address": f"127.0.0.1:{kv_port}"}
            return Heartbeater(app.state.registry.address, lambda: message, interval_s=0.1)

        beats = [beat(p_srv, "P", 14579), beat(d_srv, "D", 14580)]
        for heartbeater in beats:
            heartbeater.start()
        try:
            assert wait_for(lambda: httpx.get(f"{proxy.url}/ready").status_code == 200)
            d.behavior.delay_s = 60  # answers nothing, like a SIGSTOPped process
            stopper = threading.Timer(0.5, beats[1].stop)  # ... and stops heartbeating
            stopper.start()
            r = httpx.post(f"{proxy.url}/v1/completions", json={**BODY, "stream": stream}, timeout=30)
            stopper.join()
            assert r.status_code == 502, r.text
            error = r.json()["error"]
            assert "evicted" in error["message"] and d_srv.address in error["message"]
            assert error["code"] == "upstream_unreachable"
            assert wait_for(lambda: d.seen[0].cancelled, timeout=5)
        finally:
            for heartbeater in beats:
                heartbeater.stop()
