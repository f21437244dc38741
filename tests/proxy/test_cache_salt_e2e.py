"""Tenant isolation of the prefix cache across real processes: proxy -> prefill -> decode.

With ``--cache-salt-from-api-key`` two API keys share no cached block (the second key's
request moves as many KV bytes as a fresh prompt and the prefill node finds nothing cached),
while one key's later turn moves only what is new. A ``cache_salt`` sent straight to the
daemons (as vLLM's proxy passes the body through) is honoured the same way. Answers always
equal a colocated node's without prefix caching.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from common.request_id import make_request_id
from helpers.cluster import metric, pd_cluster

BLOCK = 16
# the embedded model: 4 layers x (K and V) x 2 KV heads x head_dim 64 x fp32, per token
BYTES_PER_BLOCK = 4 * 2 * 2 * 64 * 4 * BLOCK
NODE_ARGS = ("--block-size", str(BLOCK), "--max-num-batched-tokens", "64")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    proxy_args = ("--cache-salt-from-api-key", "--disagg-policy", "always")
    with pd_cluster(tmp_path_factory.mktemp("cache-salt"), proxy_args, NODE_ARGS,
                    (*NODE_ARGS, "--no-enable-prefix-caching")) as procs:
        yield procs


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 256) for _ in range(n)]


def _body(prompt: list[int]) -> dict:
    return {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}


def _answer(reply: httpx.Response) -> tuple[str, int]:
    assert reply.status_code == 200, reply.text
    data = reply.json()
    return data["choices"][0]["text"], data["usage"]["completion_tokens"]


def _colocated(cluster: dict, body: dict) -> tuple[str, int]:
    return _answer(httpx.post(cluster["both"].url + "/v1/completions", json=body, timeout=60))


class Moved:
    """KV bytes the decode node received and prefix-cache hits the prefill node had, per request."""

    def __init__(self, cluster: dict):
        self.cluster = cluster

    def __call__(self, send, body: dict) -> tuple[float, float]:
        d, p = self.cluster["decode"].url, self.cluster["prefill"].url
        before = metric(d, "pdserve:kv_transfer_bytes_total"), metric(p, "pdserve:prefix_cache_hits_total")
        assert send(body) == _colocated(self.cluster, body)
        return (metric(d, "pdserve:kv_transfer_bytes_total") - before[0],
                metric(p, "pdserve:prefix_cache_hits_total") - before[1])


def test_two_api_keys_share_nothing_one_key_shares(cluster: dict) -> None:
    def as_key(key: str):
        return lambda body: _answer(httpx.post(cluster["proxy"].url + "/v1/completions", json=body, timeout=60,
                                               headers={"Authorization": f"Bearer {key}"}))

    moved = Moved(cluster)
    turn1 = _prompt(130, 1)  # 9 blocks, the last one partial
    turn2 = turn1 + _prompt(40, 2)  # 11 blocks, the first 8 cached for the key that sent turn1
    assert moved(as_key("key-a"), _body(turn1)) == (9 * BYTES_PER_BLOCK, 0)
    assert moved(as_key("key-b"), _body(turn1)) == (9 * BYTES_PER_BLOCK, 0)  # as if nobody had sent it
    # a client cannot reach another tenant's blocks by sending no salt or a salt of its own
    assert moved(as_key("key-c"), {**_body(turn1), "cache_salt": "any"}) == (9 * BYTES_PER_BLOCK, 0)
    assert moved(as_key("key-a"), _body(turn2)) == (3 * BYTES_PER_BLOCK, 8 * BLOCK)


def test_a_client_salt_sent_to_the_daemons_is_honoured(cluster: dict) -> None:
    """vLLM's proxy passes the body through: the daemons' own lookups honour its cache_salt."""
    def direct(body: dict) -> tuple[str, int]:  # both legs at once, with the proxy's tagged id
        p, d = cluster["prefill"], cluster["decode"]
        headers = {"X-Request-Id": make_request_id(p.kv_addr, d.kv_addr)}
        with ThreadPoolExecutor(1) as pool:
            leg = pool.submit(httpx.post, p.url + "/v1/completions", json={**body, "max_tokens": 1},
                              headers=headers, timeout=60)
            answer = _answer(httpx.post(d.url + "/v1/completions", json=body, headers=headers, timeout=60))
            assert leg.result().status_code == 200
        return answer

    moved = Moved(cluster)
    turn1 = _prompt(130, 3)
    turn2 = turn1 + _prompt(40, 4)
    assert moved(direct, {**_body(turn1), "cache_salt": "s1"}) == (9 * BYTES_PER_BLOCK, 0)
    assert moved(direct, {**_body(turn1), "cache_salt": "s2"}) == (9 * BYTES_PER_BLOCK, 0)
    assert moved(direct, _body(turn1)) == (9 * BYTES_PER_BLOCK, 0)  # unsalted is a tenant of its own
    assert moved(direct, {**_body(turn2), "cache_salt": "s2"}) == (3 * BYTES_PER_BLOCK, 8 * BLOCK)
