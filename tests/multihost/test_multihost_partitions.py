"""Partitions across hosts: silence, not a dead process (no RST, no ICMP, packets just vanish).

- P and D lose each other in the middle of a transfer (the P->D link is throttled so the
  KV takes seconds; the cut comes once D has received part of it): the decode leg ends
  with a clear error within the transfer deadline, both sides free their blocks, and once
  the link is back the same pair serves again;
- a daemon loses the proxy: evicted within three heartbeats, sent nothing meanwhile,
  registered again once healed;
- the proxy can reach D but not P: requests go to the other P or fail fast, never hang;
- the proxy loses P while P prefills (prefill_first): retried on the other P in seconds.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from mh_cluster import (HEARTBEAT_S, KV_LEASE_S, KV_TIMEOUT_S, PROMPTS, UNREACHABLE_COOLDOWN_S, assert_nothing_leaked,
                        colocated_text, complete, process_counts, warm_pairs,
                        node_requests, registered, serve_pair, tagged, text_of, wait_for)

from common.request_id import make_request_id
from helpers.cluster import metric, wait_idle

SLACK_S = 3.0  # scheduling on a busy 2-core machine: polling, process wake-ups


def test_partition_between_p_and_d_mid_transfer(cluster):
    bed, (p1, _), (d1, _) = cluster.bed, cluster.prefills, cluster.decodes
    warm = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    serve_pair(p1, d1, warm)  # the pair exists: the cut hits a built pair, not the handshake
    # tokens no other request sent: neither prefix cache holds them, so the whole KV (~6 MB) moves
    body = {"prompt": list(range(2040, 540, -1)), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    expected = colocated_text(cluster, body)
    for node in (p1, d1):
        wait_idle(node.url)
    counts = [node.counts() for node in (p1, d1)]
    failures = metric(d1.url, "pdserve:kv_transfer_failures_total")
    rid = make_request_id(p1.kv_addr, d1.kv_addr)
    bed.throttle(p1.host, d1.host, "8mbit")  # ~6 s for the KV: the cut lands while it is on the wire
    try:
        with ThreadPoolExecutor(2) as pool:
            rx0 = bed.rx_bytes(d1.host)
            decode_leg = pool.submit(tagged, d1, body, rid)
            prefill_leg = pool.submit(tagged, p1, {**body, "max_tokens": 1}, rid)
            wait_for("KV bytes arriving at D", lambda: bed.rx_bytes(d1.host) - rx0 > 512 * 1024, 60)
            assert not decode_leg.done(), decode_leg.result().text
            bed.cut(p1.host, d1.host)
            cut_at = time.monotonic()
            r = decode_leg.result(timeout=KV_LEASE_S + KV_TIMEOUT_S + 30)
            elapsed = time.monotonic() - cut_at
            prefill_leg.result(timeout=60)
        assert r.status_code >= 500, r.text
        message = r.json()["error"]["message"]
        assert "prefill" in message or "producer" in message, message
        assert elapsed < KV_TIMEOUT_S + 2 * HEARTBEAT_S + SLACK_S, f"decode failed only after {elapsed:.1f} s"
        # both sides free their blocks: D at once, P when its send times out or its lease ends
        wait_idle(d1.url, timeout=SLACK_S)
        wait_idle(p1.url, timeout=KV_LEASE_S + KV_TIMEOUT_S + SLACK_S)
        assert metric(d1.url, "pdserve:kv_transfer_failures_total") > failures
    finally:
        bed.heal(p1.host, d1.host)
        bed.clear_netem(p1.host)
    # the link is back: the same pair serves the same answer (its data-plane pair rebuilt)
    assert serve_pair(p1, d1, body) == expected
    for node in (p1, d1):
        wait_idle(node.url)
    for node, (t0, f0) in zip((p1, d1), counts):
        t1, f1 = node.counts()
        assert t1 <= t0 + 1 and f1 <= f0 + 4, f"{node.name}: threads {t0}->{t1}, fds {f0}->{f1}"


def test_partition_between_daemon_and_proxy(cluster):
    bed, proxy, d2 = cluster.bed, cluster.proxy, cluster.decodes[1]
    expected = {p: text_of(complete(cluster.colocated.url, p)) for p in PROMPTS}
    warm_pairs(cluster.prefills, cluster.decodes)
    counts = process_counts(cluster.members)
    try:
        bed.cut(proxy.host, d2.host)
        took = wait_for("d2 evicted", lambda: registered(proxy) == {"P": 2, "D": 1},
                        3 * HEARTBEAT_S + 1 + SLACK_S)
        assert took <= 3 * HEARTBEAT_S + 1 + SLACK_S
        sent = node_requests(proxy, d2)
        for prompt in PROMPTS:  # all served, none by d2
            assert text_of(complete(proxy.url, prompt)) == expected[prompt]
        assert node_requests(proxy, d2) == sent
    finally:
        bed.heal(proxy.host, d2.host)
    wait_for("d2 registered again", lambda: registered(proxy) == {"P": 2, "D": 2}, 30)
    sent = node_requests(proxy, d2)
    for prompt in PROMPTS:
        assert text_of(complete(proxy.url, prompt)) == expected[prompt]
    assert node_requests(proxy, d2) > sent
    for node in cluster.daemons:
        wait_idle(node.url)
    assert_nothing_leaked(cluster.members, counts)


def test_proxy_reaches_d_but_not_p(cluster):
    bed, p1 = cluster.bed, cluster.prefills[0]
    expected = {p: text_of(complete(cluster.colocated.url, p)) for p in PROMPTS}
    for proxy in (cluster.proxy, cluster.proxy2):  # each proxy now holds a keep-alive socket to P1
        for prompt in PROMPTS[:2]:
            assert text_of(complete(proxy.url, prompt)) == expected[prompt]
    warm_pairs(cluster.prefills, cluster.decodes)
    counts = process_counts(cluster.members)
    try:
        for proxy in (cluster.proxy, cluster.proxy2):
            bed.cut(proxy.host, p1.host, both_ways=False)  # what the proxy sends to P1 vanishes
        for proxy in (cluster.proxy, cluster.proxy2):
            for prompt in PROMPTS:  # round robin offers P1 every other request
                t0 = time.monotonic()
                r = complete(proxy.url, prompt, timeout=120)
                took = time.monotonic() - t0
                # served by P2 after the proxy gave up on P1, or refused; never a hang
                assert took < 2 * KV_LEASE_S + SLACK_S, f"{proxy.name}: answered after {took:.1f} s"
                if r.status_code == 200:
                    assert text_of(r) == expected[prompt]
                else:
                    assert r.status_code in (502, 503, 504) and r.json()["error"]["message"], r.text
    finally:
        for proxy in (cluster.proxy, cluster.proxy2):
            bed.heal(proxy.host, p1.host)
    for node in cluster.daemons:
        wait_idle(node.url, timeout=KV_LEASE_S + KV_TIMEOUT_S + SLACK_S)
    # unacknowledged, P1's heartbeats may have stalled and got it evicted: wait for it to be back
    wait_for("P1 registered again", lambda: registered(cluster.proxy) == {"P": 2, "D": 2}, 30)
    for proxy in (cluster.proxy, cluster.proxy2):
        sent = node_requests(proxy, p1)

        def served_and_p1_back() -> bool:
            for prompt in PROMPTS:
                assert text_of(complete(proxy.url, prompt)) == expected[prompt]
            return node_requests(proxy, p1) > sent

        # a leg that could not reach P1 keeps it out of rotation for --unreachable-cooldown-s
        wait_for(f"{proxy.name} sends to P1 again", served_and_p1_back, UNREACHABLE_COOLDOWN_S + 30)
    assert_nothing_leaked(cluster.members, counts)


def test_proxy_and_p_partitioned_while_prefill_runs(cluster):
    """prefill_first waits for P's answer; a partition swallows it. The proxy must notice the
    silent connection and try the other P (or fail), not wait out its prefill timeout."""
    bed, proxy, p1 = cluster.bed, cluster.proxy2, cluster.prefills[0]
    # a prompt no earlier test sent: a prefix-cache hit would make the prefill too short to cut
    body = {"prompt": list(range(300, 1800)), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    expected = colocated_text(cluster, body)

    def ask() -> tuple[int, str, float]:
        t0 = time.monotonic()
        r = httpx.post(proxy.url + "/v1/completions", json=body, timeout=120)
        return r.status_code, r.text, time.monotonic() - t0

    try:
        with ThreadPoolExecutor(2) as pool:
            answers = [pool.submit(ask) for _ in range(2)]  # round robin: one of them runs on P1
            wait_for("P1 prefilling", lambda: metric(p1.url, "pdserve:kv_cache_usage_perc") > 0, 30)
            bed.cut(proxy.host, p1.host)
            results = [a.result() for a in answers]
    finally:
        bed.heal(proxy.host, p1.host)
    for status, text, took in results:
        assert took < KV_TIMEOUT_S + 2 * KV_LEASE_S, f"answered after {took:.1f} s"
        if status == 200:
            assert httpx.Response(200, text=text).json()["choices"][0]["text"] == expected
        else:
            assert status in (502, 503, 504), text
    for node in cluster.daemons:
        wait_idle(node.url, timeout=KV_LEASE_S + KV_TIMEOUT_S + SLACK_S)
