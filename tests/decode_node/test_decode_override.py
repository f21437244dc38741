"""The decode node overrides a remote tag for a prompt it has cached (adaptive disaggregation).

Real processes: a prefill daemon, a decode daemon and a colocated reference. A prompt served
once through the pair is cached on the decode node; the same prompt tagged remote again is
computed there (its last block only), pulls no KV, and the prefill node is told to drop what it
computed: its leg still answers, no bytes move on either side, no lease expires, and every
block is free again on both nodes. A prompt the decode node lacks is pulled as before.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from disagg_client import disaggregated, post

from helpers.cluster import all_ready, metric, start, wait_idle

BLOCK = 16
BYTES_PER_BLOCK = 4 * 2 * 2 * 64 * 4 * BLOCK  # embedded model: layers x (K, V) x KV heads x head_dim x fp32
OVERRIDES = "pdserve:decode_prefill_overrides_total"


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory):
    tmp: Path = tmp_path_factory.mktemp("decode-override")
    args = ("--max-num-batched-tokens", "64", "--block-size", str(BLOCK))
    started = {role: start(role, tmp, *args, *extra, name=role, wait=False)
               for role, extra in (("both", ("--no-enable-prefix-caching",)), ("prefill", ()), ("decode", ()))}
    with all_ready(started):  # loaded together, stopped together
        yield started


def _counters(nodes: dict) -> dict[str, float]:
    return {"d_bytes": metric(nodes["decode"].url, "pdserve:kv_transfer_bytes_total"),
            "p_bytes": metric(nodes["prefill"].url, "pdserve:kv_transfer_bytes_total"),
            "p_leases_expired": metric(nodes["prefill"].url, "pdserve:kv_leases_expired_total"),
            "overrides": metric(nodes["decode"].url, OVERRIDES)}


def _colocated(both, body: dict) -> tuple[str, int]:
    r = post(both.url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.json()["usage"]["completion_tokens"]


@pytest.mark.parametrize("order", ["concurrent", "prefill_first"])
def test_a_remote_tag_for_a_cached_prompt_is_prefilled_on_decode(nodes: dict, order: str) -> None:
    rng = random.Random(order)
    body = {"prompt": [rng.randrange(4, 256) for _ in range(150)], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True}
    expected = _colocated(nodes["both"], body)
    before = _counters(nodes)
    assert disaggregated(nodes["prefill"], nodes["decode"], "/v1/completions", body, order) == expected
    first = _counters(nodes)
    assert first["d_bytes"] - before["d_bytes"] == 10 * BYTES_PER_BLOCK  # not cached yet: pulled
    assert first["overrides"] == before["overrides"]
    for name in ("prefill", "decode"):
        wait_idle(nodes[name].url)

    # now 9 of its 10 blocks are cached on the decode node: the rest (6 tokens) is computed there
    assert disaggregated(nodes["prefill"], nodes["decode"], "/v1/completions", body, order) == expected
    for name in ("prefill", "decode"):
        wait_idle(nodes[name].url)  # every block free again: the prefill node dropped its copy
    after = _counters(nodes)
    assert after["overrides"] == first["overrides"] + 1
    assert after["d_bytes"] == first["d_bytes"] and after["p_bytes"] == first["p_bytes"]
    assert after["p_leases_expired"] == before["p_leases_expired"]  # dropped when told, not at lease end
