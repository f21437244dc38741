"""The peer tier (``--kv-peer-fetch on``, issue 35) on real processes: a proxy (round robin, every
prompt prefilled on its decode node), one prefill node and two decode nodes with the peer tier on.

A prompt computed on D1 is fetched, not computed, by D2: when the request names D1 itself (the
hint a proxy adds, here sent straight to D2) and when the proxy routes the same prompt to D2 and
adds the hint from D1's KV events; and when D1's pool has evicted the prefix into its file tier (D1
alone has one, and a small pool), read from D1's files for D2. The answers equal D1's. A hint naming
a peer the registry did not vouch for is ignored; a hint naming a peer that died costs a compute,
not an answer.
"""

from __future__ import annotations

import random
from pathlib import Path

import httpx
import pytest
from helpers.cluster import all_ready, labelled, metric, start
from helpers.waiting import wait_until

from common.request_id import LOCAL_PREFILL, make_request_id

HITS = "pdserve:kv_tier_hits_total"
BLOCK = 16
POOL_BLOCKS = 48  # D1's pool: four 200-token prompts evict a fifth's blocks into its file tier


def prompt(seed: int, length: int = 200) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def body(tokens: list[int], **extra) -> dict:
    return {"prompt": tokens, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp: Path = tmp_path_factory.mktemp("peer-tier")
    proxy = start("proxy", tmp, "--policy", "round_robin", "--disagg-policy", "never", wait=False)
    node = ("--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5", "--block-size", str(BLOCK),
            "--kv-peer-fetch", "on", "--kv-tier-load", "always", "--kv-timeout-s", "1")
    procs = {"proxy": proxy, "prefill": start("prefill", tmp, *node, wait=False)}
    d1_files = ("--kv-disk-dir", str(tmp / "d1-files"), "--num-kv-blocks", str(POOL_BLOCKS))
    for name, extra in (("d1", d1_files), ("d2", ())):
        procs[name] = start("decode", tmp, *node, *extra, name=name, wait=False)
    with all_ready(procs):
        for name in ("d1", "d2"):  # each knows the other (and the prefill node) as a peer
            wait_until(lambda name=name: metric(procs[name].url, "pdserve:kv_peers") >= 2,
                       f"{name} to hear its peers from the registry", timeout=30)
            wait_until(lambda name=name: labelled(proxy.url, "pdserve:proxy_kv_events_fresh",
                                                  node=f"127.0.0.1:{procs[name].port}") == 1,
                       f"the proxy to follow {name}'s KV events", timeout=30)
        yield procs


def direct(node, tokens: list[int], **extra) -> dict:
    """``tokens`` computed on ``node`` alone (tagged for a local prefill), past the proxy."""
    rid = make_request_id(LOCAL_PREFILL, node.kv_addr)
    r = httpx.post(node.url + "/v1/completions", json=body(tokens, **extra), headers={"X-Request-Id": rid},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def synced(cluster: dict) -> bool:
    """Every event the decode nodes published has been applied by the proxy."""
    for name in ("d1", "d2"):
        d = cluster[name]
        if metric(d.url, "pdserve:kv_events_pending"):  # read first: once 0, the next scrape's number counts them
            return False
        node = f"127.0.0.1:{d.port}"
        if labelled(cluster["proxy"].url, "pdserve:proxy_kv_events_applied_seq", node=node) != metric(
                d.url, "pdserve:kv_events_seq"):
            return False
    return True


def peer_hits(node) -> float:
    return labelled(node.url, HITS, tier="peer")


def cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_a_prefix_named_by_the_hint_is_fetched_from_the_peer(cluster):
    d1, d2 = cluster["d1"], cluster["d2"]
    tokens = prompt(1)
    first = direct(d1, tokens)
    hits = peer_hits(d2)
    second = direct(d2, tokens, pdserve_peer_prefix={"kv_addr": d1.kv_addr, "blocks": len(tokens) // BLOCK})
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    full = (len(tokens) - 1) // BLOCK  # the block holding the last token is always computed
    assert cached(second) == full * BLOCK
    assert peer_hits(d2) - hits == full
    assert metric(d1.url, "pdserve:kv_peer_served_blocks") >= full


def test_a_hint_naming_a_stranger_is_ignored(cluster):
    d2 = cluster["d2"]
    tokens = prompt(2)
    reference = direct(cluster["d1"], tokens)
    hits = peer_hits(d2)
    reply = direct(d2, tokens, pdserve_peer_prefix={"kv_addr": "127.0.0.1:9", "blocks": 12})
    assert reply["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(reply) == 0 and peer_hits(d2) == hits


def test_the_proxy_adds_the_hint_when_it_routes_a_prefix_away_from_its_holder(cluster):
    proxy, d1, d2 = cluster["proxy"], cluster["d1"], cluster["d2"]
    tokens = prompt(3)
    hints = labelled(proxy.url, "pdserve:proxy_peer_hints_total")
    hits = peer_hits(d1) + peer_hits(d2)
    texts = []
    for _ in range(2):  # round robin: the second goes to the other decode node, which fetches the prefix
        r = httpx.post(proxy.url + "/v1/completions", json=body(tokens), timeout=60)
        assert r.status_code == 200, r.text
        texts.append(r.json()["choices"][0]["text"])
        wait_until(lambda: synced(cluster), "the proxy to apply the decode nodes' KV events", timeout=30)
    assert texts[0] == texts[1]
    assert labelled(proxy.url, "pdserve:proxy_peer_hints_total") > hints
    assert peer_hits(d1) + peer_hits(d2) > hits


def test_a_prefix_the_peer_keeps_in_its_file_tier_is_read_for_the_asker(cluster):
    d1, d2 = cluster["d1"], cluster["d2"]
    tokens = prompt(5)
    full = (len(tokens) - 1) // BLOCK
    first = direct(d1, tokens)
    for seed in range(10, 14):  # 4 x 13 blocks through a pool of 48: the first prompt's are evicted
        direct(d1, prompt(seed))
    # its blocks are the least recently used: the first evicted, the first written
    wait_until(lambda: labelled(d1.url, "pdserve:kv_tier_blocks", tier="disk") >= full,
               "D1 to write its evicted blocks to files", timeout=30)
    served, hits = metric(d1.url, "pdserve:kv_peer_served_blocks"), peer_hits(d2)
    second = direct(d2, tokens, pdserve_peer_prefix={"kv_addr": d1.kv_addr, "blocks": full})
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert cached(second) == full * BLOCK and peer_hits(d2) - hits == full
    assert metric(d1.url, "pdserve:kv_peer_served_blocks") - served == full
    assert labelled(d1.url, "pdserve:kv_tier_served_total", tier="disk") == full  # from D1's files, all of them
    assert labelled(d1.url, "pdserve:kv_tier_hits_total", tier="disk") == 0  # serving a peer is no hit of D1's


def test_a_peer_that_died_costs_a_compute_not_an_answer(cluster):
    d1, d2 = cluster["d1"], cluster["d2"]
    tokens = prompt(4)
    reference = direct(d1, tokens)
    d1.kill()
    reply = direct(d2, tokens, pdserve_peer_prefix={"kv_addr": d1.kv_addr, "blocks": len(tokens) // BLOCK})
    assert reply["choices"][0]["text"] == reference["choices"][0]["text"]
    assert cached(reply) == 0
