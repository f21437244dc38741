"""A dead or unreachable peer ends a request with a clear error and frees its blocks.

Each case starts a victim daemon, kills it at the worst moment with SIGKILL, and checks
that the survivor answers within its deadline, frees every block, and keeps serving.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from disagg_client import disaggregated, post, prefill_body

from common.request_id import make_request_id
from helpers.cluster import all_ready, free_port, metric, start, wait_idle
from helpers.waiting import wait_until

TIMEOUT_S = 2.0
LEASE_S = 3.0
ARGS = ("--kv-timeout-s", str(TIMEOUT_S), "--kv-lease-s", str(LEASE_S))
BODY = {"prompt": list(range(10, 90)), "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("failures")
    procs = {"prefill": start("prefill", tmp, *ARGS, wait=False),
             # no prefix cache: a prompt served before would be computed there (the override of a
             # remote tag for a cached prompt), and these tests need every request to ask its prefill node
             "decode": start("decode", tmp, *ARGS, "--no-enable-prefix-caching", wait=False)}
    with all_ready(procs):
        yield tmp, procs["prefill"], procs["decode"]


def _wait_until_allocated(node, timeout: float = 20.0) -> None:
    """Until ``node`` holds KV blocks (a decode node: allocated and asked its prefill node)."""
    wait_until(lambda: metric(node.url, "pdserve:kv_cache_usage_perc") > 0, f"{node.name} allocates blocks",
               timeout, step=0.02)


def _still_serves(prefill, decode) -> None:
    text, n = disaggregated(prefill, decode, "/v1/completions", BODY)
    assert n == 8 and text
    wait_idle(prefill.url)
    wait_idle(decode.url)


def test_prefill_killed_after_decode_allocated(pair) -> None:
    tmp, prefill, decode = pair
    victim = start("prefill", tmp, *ARGS, name="prefill-victim")
    try:
        rid = make_request_id(victim.kv_addr, decode.kv_addr)
        with ThreadPoolExecutor(1) as pool:
            leg = pool.submit(post, decode.url, "/v1/completions", BODY, rid)
            _wait_until_allocated(decode)  # D allocated blocks and asked P for the KV
            victim.kill()
            r = leg.result()
    finally:
        victim.kill()
    assert r.status_code >= 500
    msg = r.json()["error"]["message"]
    assert "producer" in msg or "prefill" in msg
    # noticed by the pings (or the pair), not by D's own give-up deadline (lease + timeout)
    assert "timed out waiting" not in msg, msg
    wait_idle(decode.url, timeout=5)
    assert metric(decode.url, "pdserve:kv_transfer_failures_total") >= 1
    _still_serves(prefill, decode)


def test_decode_killed_mid_transfer_frees_prefill_blocks(pair) -> None:
    tmp, prefill, decode = pair
    victim = start("decode", tmp, *ARGS, name="decode-victim")
    try:
        rid = make_request_id(prefill.kv_addr, victim.kv_addr)
        with ThreadPoolExecutor(1) as pool:
            pool.submit(post, victim.url, "/v1/completions", BODY, rid, 30)
            _wait_until_allocated(victim)
            victim.kill()
        p = post(prefill.url, "/v1/completions", prefill_body(BODY), rid)
        assert p.status_code == 200, p.text  # prefill itself succeeded; only the push had nowhere to go
    finally:
        victim.kill()
    wait_idle(prefill.url, timeout=LEASE_S + TIMEOUT_S + 5)
    _still_serves(prefill, decode)


def test_prefill_times_each_transfer_it_sends(pair) -> None:
    _, prefill, decode = pair
    before = metric(prefill.url, "pdserve:kv_transfer_seconds_count")
    _still_serves(prefill, decode)  # waits until prefill freed the blocks, i.e. got the ACK
    assert metric(prefill.url, "pdserve:kv_transfer_seconds_count") == before + 1
    assert metric(prefill.url, "pdserve:kv_transfer_seconds_sum") > 0


def test_unclaimed_kv_is_freed_when_the_lease_expires(pair) -> None:
    _, prefill, decode = pair
    before = metric(prefill.url, "pdserve:kv_leases_expired_total")
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)  # the decode leg never comes
    p = post(prefill.url, "/v1/completions", prefill_body(BODY), rid)
    assert p.status_code == 200
    assert metric(prefill.url, "pdserve:kv_cache_usage_perc") > 0  # held for the decode node
    wait_idle(prefill.url, timeout=LEASE_S + 5)
    expired = [line for line in prefill.log.read_text().splitlines() if f"request {rid}: KV lease" in line]
    assert len(expired) == 1 and " WARNING " in expired[0] and "before any decode node asked" in expired[0]
    assert metric(prefill.url, "pdserve:kv_leases_expired_total") == before + 1
    # a decode leg arriving after the lease gets the producer's clear answer, not a hang
    r = post(decode.url, "/v1/completions", BODY, rid)
    assert r.status_code >= 500 and "lease expired" in r.json()["error"]["message"]
    wait_idle(decode.url)


def test_unreachable_prefill_node_fails_fast(pair) -> None:
    _, prefill, decode = pair
    rid = make_request_id(f"127.0.0.1:{free_port()}", decode.kv_addr)
    r = post(decode.url, "/v1/completions", BODY, rid)
    assert r.status_code >= 500
    msg = r.json()["error"]["message"]
    assert "127.0.0.1" in msg and "unreachable" in msg, msg  # the handshake's deadline, named
    wait_idle(decode.url)
    _still_serves(prefill, decode)


def test_client_disconnect_while_waiting_for_kv_frees_decode_blocks(pair) -> None:
    _, prefill, decode = pair
    import httpx

    rid = make_request_id(prefill.kv_addr, decode.kv_addr)  # prefill leg never sent: D waits
    with httpx.stream("POST", decode.url + "/v1/completions", json={**BODY, "stream": True},
                      headers={"X-Request-Id": rid}, timeout=30) as r:
        assert r.status_code == 200  # the stream opened: the node is waiting for the KV
        _wait_until_allocated(decode)
    # the client is gone: D aborts, tells P, and frees the blocks once the receive stopped
    wait_idle(decode.url, timeout=TIMEOUT_S + 5)
    _still_serves(prefill, decode)


def test_request_refused_by_decode_releases_prefill_kv_at_once(pair) -> None:
    """The prefill leg (max_tokens 1) succeeds, the decode node refuses the real body: the
    prefill node must drop the KV now, not hold it until its lease ends. Keyless, the id is
    unverified, so decode tells only a prefill node it already talks to (never connects for a
    refused id): one served request first opens that connection."""
    _, prefill, decode = pair
    _still_serves(prefill, decode)
    leases_before = metric(prefill.url, "pdserve:kv_leases_expired_total")
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)
    p = post(prefill.url, "/v1/completions", prefill_body(BODY), rid)
    assert p.status_code == 200
    assert metric(prefill.url, "pdserve:kv_cache_usage_perc") > 0
    r = post(decode.url, "/v1/completions", {**BODY, "max_tokens": -1}, rid)
    assert r.status_code == 400
    wait_idle(prefill.url, timeout=LEASE_S + 10)
    assert metric(prefill.url, "pdserve:kv_leases_expired_total") == leases_before  # released, not expired
