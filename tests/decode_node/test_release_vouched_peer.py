"""A request the decode node refuses releases its prefill node's KV at once even when it is the
first contact between the two, as long as the prefill node is one this decode node was told of
(``--kv-peers`` here; the registry's member list behind our proxy): no lease is waited out."""

from __future__ import annotations

import pytest
from disagg_client import post, prefill_body

from common.request_id import make_request_id
from helpers.cluster import metric, start, stop_all, wait_idle

LEASE_S = 30.0  # long: the release must come from the ABORT, not from the lease running out
BODY = {"prompt": list(range(10, 90)), "max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("vouched")
    procs = [start("prefill", tmp, "--kv-lease-s", str(LEASE_S), wait=False)]
    try:
        procs[0].wait_ready(timeout=60)
        procs.append(start("decode", tmp, "--kv-peers", procs[0].kv_addr))
        yield procs[0], procs[1]
    finally:
        stop_all(procs)


def test_first_contact_refusal_releases_prefill_kv_before_the_lease(pair) -> None:
    prefill, decode = pair
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)
    assert post(prefill.url, "/v1/completions", prefill_body(BODY), rid).status_code == 200
    assert metric(prefill.url, "pdserve:kv_cache_usage_perc") > 0  # held for a decode node
    r = post(decode.url, "/v1/completions", {**BODY, "max_tokens": -1}, rid)
    assert r.status_code == 400
    wait_idle(prefill.url, timeout=LEASE_S / 2)  # freed by the ABORT: the lease is far off
    assert metric(prefill.url, "pdserve:kv_leases_expired_total") == 0
