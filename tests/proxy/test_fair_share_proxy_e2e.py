"""Fair share at the proxy on real processes (proxy/fair_share.py): a proxy (prefix_aware), one
prefill node and two decode nodes of one slot each (``--max-num-seqs 1``).

Client C (its own API key) holds both decode slots and queues a request behind each, so both
nodes' heartbeats say requests wait. Client A (another key) then sends one prompt again and again:
prefix_aware alone would keep every copy on the node that saw it first (the loads stay within its
balance margin), but with every node saturated and C in flight the proxy spreads A's requests
over both nodes, counting ``pdserve:proxy_route_decisions_total{reason="fair_share"}``. The client
identity comes from the ``Authorization`` header the proxy received, the saturation from the
nodes' heartbeats: what crosses processes here. Asserted on legs counted per node, never on time.
"""

from __future__ import annotations

import threading

import httpx
from helpers.cluster import all_ready, labelled, metric, start
from helpers.waiting import wait_for, wait_until

A_BODY = {"prompt": "one prompt that prefix routing would keep sending to the same node " * 2,
          "max_tokens": 4, "ignore_eos": True, "temperature": 0}
LEGS = "pdserve:proxy_node_requests_total"
ROUTES = "pdserve:proxy_route_decisions_total"


def test_a_clients_requests_are_spread_when_every_decode_node_is_saturated(tmp_path):
    proxy = start("proxy", tmp_path, "--policy", "prefix_aware", "--disagg-policy", "always", wait=False)
    node_args = ("--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5")
    procs = {"proxy": proxy, "prefill": start("prefill", tmp_path, *node_args, wait=False)}
    for name in ("d1", "d2"):
        procs[name] = start("decode", tmp_path, *node_args, "--max-num-seqs", "1", name=name, wait=False)
    stop = threading.Event()
    threads: list[threading.Thread] = []
    a_status: list[int] = []

    def c_stream(i: int) -> None:
        """A long request of C, read until the test is done (closing it aborts it on the nodes)."""
        body = {"prompt": f"client C's request number {i}", "max_tokens": 3000, "ignore_eos": True, "stream": True}
        try:
            with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=300,
                              headers={"Authorization": "Bearer key-C"}) as resp:
                for _ in resp.iter_lines():
                    if stop.is_set():
                        return
        except httpx.HTTPError:
            pass

    def a_request() -> None:
        resp = httpx.post(proxy.url + "/v1/completions", json=A_BODY, timeout=300,
                          headers={"Authorization": "Bearer key-A"})
        a_status.append(resp.status_code)

    with all_ready(procs):
        decodes = [f"127.0.0.1:{procs[name].port}" for name in ("d1", "d2")]

        def legs() -> list[float]:
            return [labelled(proxy.url, LEGS, role="decode", node=d) for d in decodes]

        def send(target, *args) -> None:
            """Start a request and wait until the proxy has sent its decode leg: picks never overlap."""
            before = sum(legs())
            threads.append(threading.Thread(target=target, args=args))
            threads[-1].start()
            wait_until(lambda: sum(legs()) > before, "the request's decode leg is sent", 60)

        try:
            for i in range(4):  # C's four prompts share nothing: least loaded, two a node
                send(c_stream, i)

            def saturated() -> bool:  # each node runs one of C's requests and queues another
                return all(metric(procs[name].url, "pdserve:num_requests_waiting") >= 1 for name in ("d1", "d2"))

            # a node that got one of the four only, or finished one before this looked (3,000 tokens
            # take seconds on a fast engine), gets another of C's requests
            while not wait_for(saturated, 10, 0.02):
                assert i < 12, "both decode nodes never ran one of C's requests and queued another"
                i += 1
                send(c_stream, i)
            before = legs()
            sent = 0
            # A's copies go where prefix_aware wants until a heartbeat has told the proxy both nodes
            # are full; from the first one it moves, as many again even out whatever went before
            while labelled(proxy.url, ROUTES, node_role="decode", reason="fair_share") < 1:
                assert sent < 40, "the proxy never moved one of A's requests"
                send(a_request)
                sent += 1
            for _ in range(sent):
                send(a_request)
            a_legs = [after - b for after, b in zip(legs(), before)]
            assert sum(a_legs) == 2 * sent
            assert abs(a_legs[0] - a_legs[1]) <= 1, f"A's requests per decode node: {a_legs}"
        finally:
            stop.set()
            for t in threads:
                t.join(120)
    assert a_status and all(s == 200 for s in a_status), a_status
