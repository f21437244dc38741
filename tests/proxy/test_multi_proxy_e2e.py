"""Several proxies, all active (issue 31, items 1 and 3), on real processes: two proxies, one prefill
node, two decode nodes and a colocated node for reference, under one cluster key.

Every daemon is started with ``--proxy A,B`` and heartbeats both; each proxy builds its own view
from those heartbeats, and each proxy's signed ids are taken by every daemon (a daemon with a key
serves nothing unsigned). In order, because the last test kills a proxy: both proxies list every
node; requests alternating proxies get the colocated answers, from both decode nodes; then the
kill drill (helpers/proxy_drill.py): ``kill -9`` of proxy A under load, 0 failures through B, A's
failed requests failed fast and a retry through B answered right, the daemons serve on; A restarted
on its ports routes again (waited for with a deadline: bench/proxy_ha.py measures how soon).
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from helpers.cluster import Proc, metric, start, stop_all
from helpers.proxy_drill import (
    BODY,
    PROMPTS,
    Load,
    complete,
    expected_texts,
    restart_and_time,
    wait_for_counts,
)
from helpers.waiting import wait_until

from common.cluster_auth import ClusterKey

pytestmark = pytest.mark.slow

HEARTBEAT_S = 0.5


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    tmp = tmp_path_factory.mktemp("multi-proxy")
    key = ("--cluster-key-file", str(ClusterKey.generate(tmp / "cluster.key")))
    procs: dict[str, Proc] = {}
    try:
        for name in ("proxy_a", "proxy_b"):
            # always: every request crosses P -> D, so each proxy's ids are checked by both daemons
            procs[name] = start("proxy", tmp, *key, "--disagg-policy", "always", name=name, wait=False)
        proxies = ",".join(f"127.0.0.1:{procs[name].kv_port}" for name in ("proxy_a", "proxy_b"))
        node = (*key, "--proxy", proxies, "--heartbeat-interval-s", str(HEARTBEAT_S))
        procs["prefill"] = start("prefill", tmp, *node, wait=False)
        procs["decode1"] = start("decode", tmp, *node, name="decode1", wait=False)
        procs["decode2"] = start("decode", tmp, *node, name="decode2", wait=False)
        procs["both"] = start("both", tmp, wait=False)
        for proc in procs.values():
            proc.wait_ready()
        for proxy in (procs["proxy_a"], procs["proxy_b"]):
            wait_until(lambda p=proxy: _nodes(p) == {"P": 1, "D": 2}, f"every node registered with {proxy.name}")
        yield procs
    finally:
        stop_all(procs.values())


def _nodes(proxy: Proc) -> dict:
    return httpx.get(proxy.url + "/ready", timeout=5).json().get("nodes")


def test_each_proxy_lists_every_node_from_the_nodes_own_heartbeats(cluster: dict[str, Proc]) -> None:
    for name in ("proxy_a", "proxy_b"):
        text = httpx.get(cluster[name].url + "/metrics", timeout=5).text
        assert 'pdserve:registered_nodes{role="proxy",type="P"} 1.0' in text
        assert 'pdserve:registered_nodes{role="proxy",type="D"} 2.0' in text


def test_requests_alternating_proxies_get_the_colocated_answers(cluster: dict[str, Proc]) -> None:
    expected = expected_texts(cluster["both"])
    before = [metric(cluster[d].url, "pdserve:generation_tokens_total") for d in ("decode1", "decode2")]
    for i in range(8):  # each proxy round-robins the two decode nodes: each takes both proxies' ids
        prompt = PROMPTS[i % len(PROMPTS)]
        assert complete(cluster[("proxy_a", "proxy_b")[i % 2]], prompt) == (200, expected[prompt])
    body = {**BODY, "prompt": PROMPTS[1]}
    for name in ("proxy_a", "proxy_b"):  # not streamed too
        got = httpx.post(cluster[name].url + "/v1/completions", json=body, timeout=60).json()
        assert got["choices"][0]["text"] == expected[PROMPTS[1]]
    after = [metric(cluster[d].url, "pdserve:generation_tokens_total") for d in ("decode1", "decode2")]
    assert all(a > b for a, b in zip(after, before)), "a decode node served none of the requests"


def test_kill_one_proxy_under_load_then_restart_it(cluster: dict[str, Proc]) -> None:
    victim, survivor = cluster["proxy_a"], cluster["proxy_b"]
    expected = expected_texts(cluster["both"])
    with Load(victim, survivor, expected) as load:
        wait_for_counts(load, lambda c: c.succeeded >= 6, "some requests through both proxies before the kill")
        load.kill_victim()  # as a stream through it has begun
        wait_for_counts(load, lambda c: c.survivor_ok >= 6 and c.retried >= 2,
                        "requests through the survivor, and retries of the victim's, after the kill")
    counts = load.counts
    assert counts.failed == [], counts.failed  # none through B; every retry of A's answered right
    assert counts.cut_in_flight >= 1 and counts.retried == counts.failed_fast  # no hang: cut, then retried
    for name in ("prefill", "decode1", "decode2"):  # the daemons serve on
        assert httpx.get(cluster[name].url + "/health", timeout=5).status_code == 200

    comeback = restart_and_time(victim, expected)  # the same ports; it answers right once it routes
    assert comeback.after_up_s >= 0
    wait_until(lambda: _nodes(victim) == {"P": 1, "D": 2}, "every node registered again with the restarted proxy")
    for prompt in PROMPTS:
        assert complete(victim, prompt) == (200, expected[prompt])
