"""Exact prefix routing from KV events, on real processes: one proxy (prefix_aware, tokenizing with
the nodes' tokenizer), one prefill node, two decode nodes with small caches.

A prompt computed on D1 alone (sent to it directly: the proxy never saw it, so its text memory
knows nothing) is cached there; D1's events tell the proxy, and the same prompt through the proxy
goes to D1 -- the decision metric says ``prefix_events``. Once other prompts evicted those blocks
from D1, its events say so, and the prompt goes by load; the answer is the same all along.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
from helpers.cluster import all_ready, metric, start
from helpers.waiting import wait_until

from common.model.embedded import ensure_embedded_model
from common.request_id import LOCAL_PREFILL, make_request_id

ROUTES = "pdserve:proxy_route_decisions_total"
PROMPT = "The cache remembers every block of this prompt, so the proxy can send it home. " * 3
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def labelled(url: str, name: str, **labels: str) -> float:
    """The value of the series ``name`` with ``labels`` (0 when there is none yet)."""
    text = httpx.get(url + "/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp: Path = tmp_path_factory.mktemp("kv-events")
    proxy = start("proxy", tmp, "--policy", "prefix_aware", "--disagg-policy", "always",
                  "--tokenizer", str(ensure_embedded_model()), "--heartbeat-timeout-s", "3", wait=False)
    node = ("--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5", "--block-size", "16")
    procs = {"proxy": proxy, "prefill": start("prefill", tmp, *node, wait=False)}
    for name in ("d1", "d2"):  # 24 blocks of 16 tokens: two 200-token prompts evict the rest
        procs[name] = start("decode", tmp, *node, "--num-kv-blocks", "24", name=name, wait=False)
    with all_ready(procs):
        for name in ("d1", "d2"):
            wait_until(lambda name=name: labelled(proxy.url, "pdserve:proxy_kv_events_fresh",
                                                  node=f"127.0.0.1:{procs[name].port}") == 1,
                       f"the proxy follows {name}'s KV events", timeout=30)
        yield procs


def synced(cluster: dict, name: str, after: float) -> bool:
    """The decode node published past batch ``after``, and the proxy applied all it published."""
    d = cluster[name]
    published = metric(d.url, "pdserve:kv_events_seq")
    applied = labelled(cluster["proxy"].url, "pdserve:proxy_kv_events_applied_seq", node=f"127.0.0.1:{d.port}")
    fresh = labelled(cluster["proxy"].url, "pdserve:proxy_kv_events_fresh", node=f"127.0.0.1:{d.port}")
    return published > after and applied == published and fresh == 1


def on_d1(cluster: dict, body: dict) -> str:
    """``body`` computed by D1 alone (tagged for a local prefill), past the proxy."""
    d1 = cluster["d1"]
    rid = make_request_id(LOCAL_PREFILL, d1.kv_addr)
    r = httpx.post(d1.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def routed(cluster: dict) -> str:
    """BODY's answer through the proxy."""
    r = httpx.post(cluster["proxy"].url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def decode_legs(cluster: dict) -> dict[str, float]:
    """How many decode legs the proxy sent each decode node."""
    return {n: labelled(cluster["proxy"].url, "pdserve:proxy_node_requests_total", role="decode",
                        node=f"127.0.0.1:{cluster[n].port}") for n in ("d1", "d2")}


def test_a_prefix_cached_on_d1_routes_there_by_events_then_by_load_once_evicted(cluster) -> None:
    proxy = cluster["proxy"]
    seq = metric(cluster["d1"].url, "pdserve:kv_events_seq")
    expected = on_d1(cluster, BODY)  # cached on D1 only
    wait_until(lambda: synced(cluster, "d1", seq), "the proxy applied D1's stored blocks")
    by_events = labelled(proxy.url, ROUTES, node_role="decode", reason="prefix_events")
    before = decode_legs(cluster)
    assert routed(cluster) == expected
    after = decode_legs(cluster)
    assert (after["d1"] - before["d1"], after["d2"] - before["d2"]) == (1, 0)  # D1 took it ...
    assert labelled(proxy.url, ROUTES, node_role="decode", reason="prefix_events") == by_events + 1  # ... by events

    seq = metric(cluster["d1"].url, "pdserve:kv_events_seq")
    rng = random.Random(31)
    for _ in range(3):  # other prompts fill D1's 24 blocks: the least recently used, ours, go first
        on_d1(cluster, {"prompt": [rng.randrange(4, 256) for _ in range(200)], "max_tokens": 4, "temperature": 0})
    wait_until(lambda: synced(cluster, "d1", seq), "the proxy applied D1's evictions")
    by_load = labelled(proxy.url, ROUTES, node_role="decode", reason="load")
    assert routed(cluster) == expected  # computed again, elsewhere or not: the same answer
    assert labelled(proxy.url, ROUTES, node_role="decode", reason="load") == by_load + 1
