"""Exact prefix routing from KV events, on real processes: two proxies (prefix_aware, tokenizing
with the nodes' tokenizer; each indexes the events itself), one prefill node, two decode nodes
with small caches, registered with both proxies.

A prompt computed on D1 alone (sent to it directly: no proxy saw it, so their text memories know
nothing) is cached there; D1's events tell the proxies, and the same prompt through either proxy
goes to D1 -- the decision metric says ``prefix_events``. Once other prompts evicted those blocks
from D1, its events say so, and the prompt goes by load -- after which the other proxy follows it
to its new home, by events again; the answer is the same all along. A decode node killed and
restarted (new epoch, empty cache) is indexed from empty.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
from helpers.cluster import all_ready, labelled, metric, restart, start
from helpers.waiting import wait_until

from common.model.embedded import ensure_embedded_model
from common.request_id import LOCAL_PREFILL, make_request_id

ROUTES = "pdserve:proxy_route_decisions_total"
PROXIES = ("proxy1", "proxy2")
PROMPT = "The cache remembers every block of this prompt, so the proxy can send it home. " * 3
BODY = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp: Path = tmp_path_factory.mktemp("kv-events")
    proxies = {name: start("proxy", tmp, "--policy", "prefix_aware", "--disagg-policy", "always", "--tokenizer",
                           str(ensure_embedded_model()), name=name, wait=False)
               for name in PROXIES}
    node = ("--proxy", ",".join(f"127.0.0.1:{p.kv_port}" for p in proxies.values()), "--heartbeat-interval-s", "0.5",
            "--block-size", "16")
    procs = {**proxies, "prefill": start("prefill", tmp, *node, wait=False)}
    for name in ("d1", "d2"):  # 24 blocks of 16 tokens: two 200-token prompts evict the rest
        procs[name] = start("decode", tmp, *node, "--num-kv-blocks", "24", name=name, wait=False)
    with all_ready(procs):
        for proxy in proxies.values():
            for name in ("d1", "d2"):
                wait_until(lambda proxy=proxy, name=name: labelled(proxy.url, "pdserve:proxy_kv_events_fresh",
                                                                   node=f"127.0.0.1:{procs[name].port}") == 1,
                           f"{proxy.name} follows {name}'s KV events", timeout=30)
        yield procs


def synced(cluster: dict, name: str, after: float) -> bool:
    """The decode node published past batch ``after`` every event it had queued, and every proxy
    applied all it published."""
    d = cluster[name]
    if metric(d.url, "pdserve:kv_events_pending"):  # read first: once 0, the next scrape's number counts them
        return False
    published = metric(d.url, "pdserve:kv_events_seq")
    node = f"127.0.0.1:{d.port}"
    return published > after and all(
        labelled(cluster[p].url, "pdserve:proxy_kv_events_applied_seq", node=node) == published
        and labelled(cluster[p].url, "pdserve:proxy_kv_events_fresh", node=node) == 1 for p in PROXIES)


def on_d1(cluster: dict, body: dict) -> str:
    """``body`` computed by D1 alone (tagged for a local prefill), past the proxy."""
    d1 = cluster["d1"]
    rid = make_request_id(LOCAL_PREFILL, d1.kv_addr)
    r = httpx.post(d1.url + "/v1/completions", json=body, headers={"X-Request-Id": rid}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def routed(cluster: dict, proxy: str) -> str:
    """BODY's answer through ``proxy``."""
    r = httpx.post(cluster[proxy].url + "/v1/completions", json=BODY, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def decisions(cluster: dict, proxy: str) -> str:
    """What ``proxy`` decided so far and whether it follows each node's events (for a failure's message)."""
    text = httpx.get(cluster[proxy].url + "/metrics", timeout=5).text
    return "\n".join(line for line in text.splitlines() if line.startswith(
        ("pdserve:proxy_route_decisions_total", "pdserve:proxy_kv_events", "pdserve:proxy_node_requests_total")))


def decode_legs(cluster: dict, proxy: str) -> dict[str, float]:
    """How many decode legs ``proxy`` sent each decode node."""
    return {n: labelled(cluster[proxy].url, "pdserve:proxy_node_requests_total", role="decode",
                        node=f"127.0.0.1:{cluster[n].port}") for n in ("d1", "d2")}


def test_a_prefix_cached_on_d1_routes_there_by_events_then_by_load_once_evicted(cluster) -> None:
    seq = metric(cluster["d1"].url, "pdserve:kv_events_seq")
    expected = on_d1(cluster, BODY)  # cached on D1 only
    wait_until(lambda: synced(cluster, "d1", seq), "both proxies applied D1's stored blocks")
    for proxy in PROXIES:  # from either proxy
        url = cluster[proxy].url
        by_events = labelled(url, ROUTES, node_role="decode", reason="prefix_events")
        before = decode_legs(cluster, proxy)
        assert routed(cluster, proxy) == expected
        after = decode_legs(cluster, proxy)
        why = f"{proxy}:\n{decisions(cluster, proxy)}"
        assert (after["d1"] - before["d1"], after["d2"] - before["d2"]) == (1, 0), why  # D1 took it ...
        assert labelled(url, ROUTES, node_role="decode", reason="prefix_events") == by_events + 1, why  # ... by events

    seq = metric(cluster["d1"].url, "pdserve:kv_events_seq")
    rng = random.Random(31)
    for _ in range(3):  # other prompts fill D1's 24 blocks: the least recently used, ours, go first
        on_d1(cluster, {"prompt": [rng.randrange(4, 256) for _ in range(200)], "max_tokens": 4, "temperature": 0})
    wait_until(lambda: synced(cluster, "d1", seq), "both proxies applied D1's evictions")
    seqs = {n: metric(cluster[n].url, "pdserve:kv_events_seq") for n in ("d1", "d2")}
    by_load = labelled(cluster["proxy1"].url, ROUTES, node_role="decode", reason="load")
    before = decode_legs(cluster, "proxy1")
    assert routed(cluster, "proxy1") == expected  # computed again: the same answer
    assert labelled(cluster["proxy1"].url, ROUTES, node_role="decode", reason="load") == by_load + 1, \
        decisions(cluster, "proxy1")
    after = decode_legs(cluster, "proxy1")
    home = next(n for n in after if after[n] > before[n])

    # the prompt's blocks now live where load sent them: the other proxy follows them there by events
    wait_until(lambda: synced(cluster, home, seqs[home]), f"both proxies applied {home}'s stored blocks")
    by_events = labelled(cluster["proxy2"].url, ROUTES, node_role="decode", reason="prefix_events")
    before = decode_legs(cluster, "proxy2")
    assert routed(cluster, "proxy2") == expected
    why = f"{home}:\n{decisions(cluster, 'proxy2')}"
    assert decode_legs(cluster, "proxy2")[home] == before[home] + 1, why
    assert labelled(cluster["proxy2"].url, ROUTES, node_role="decode", reason="prefix_events") == by_events + 1, why


def test_a_restarted_decode_node_is_indexed_from_empty(cluster) -> None:
    """kill -9 of D1 and a restart on the same ports: a new process, a new epoch, an empty cache. The
    proxies drop what the old one had and follow the new one; a prompt only the old one held goes by load."""
    body = {**BODY, "prompt": "Only the process that dies will have computed this prompt, block by block. " * 3}
    seq = metric(cluster["d1"].url, "pdserve:kv_events_seq")
    expected = on_d1(cluster, body)
    wait_until(lambda: synced(cluster, "d1", seq), "both proxies applied D1's stored blocks")
    cluster["d1"].kill()
    restart(cluster["d1"])
    wait_until(lambda: synced(cluster, "d1", -1) and metric(cluster["d1"].url, "pdserve:kv_events_seq") < seq,
               "both proxies follow the new D1 (its numbers start again)")
    by_load = labelled(cluster["proxy1"].url, ROUTES, node_role="decode", reason="load")
    r = httpx.post(cluster["proxy1"].url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected, r.text
    assert labelled(cluster["proxy1"].url, ROUTES, node_role="decode", reason="load") == by_load + 1, \
        decisions(cluster, "proxy1")
