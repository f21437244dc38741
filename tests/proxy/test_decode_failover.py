"""A decode node killed outright (issue 22, finding 3), against real processes: proxy, one
prefill and two decode daemons. After ``kill -9`` of one decode node every new request is
answered 200, long before the proxy's heartbeat timeout (120 s here) would evict it: a leg
that cannot reach the dead node is retried on the other one (nothing had reached the
client), and the dead node is skipped for ``--unreachable-cooldown-s``."""

from __future__ import annotations

import httpx
import pytest

from helpers.cluster import start, stop_all
from helpers.waiting import wait_until

BODY = {"model": "pdserve-tiny", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}


@pytest.fixture
def two_decodes(tmp_path):
    procs = []
    try:
        proxy = start("proxy", tmp_path, "--heartbeat-timeout-s", "120", "--disagg-policy", "always", wait=False)
        procs.append(proxy)
        reg = ("--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5")
        procs.append(start("prefill", tmp_path, *reg, wait=False))
        procs += [start("decode", tmp_path, *reg, name=f"decode{i}", wait=False) for i in range(2)]
        for p in procs:
            p.wait_ready()
        wait_until(lambda: httpx.get(proxy.url + "/ready").json().get("nodes", {}).get("D") == 2,
                   "both decode nodes registered", 60, step=0.1)
        yield procs
    finally:
        stop_all(procs)


def _post(url: str, stream: bool) -> httpx.Response:
    with httpx.Client(timeout=120) as client:
        r = client.post(url + "/v1/completions", json={**BODY, "stream": stream})
        r.read()
        return r


def test_requests_after_a_decode_node_is_killed_all_succeed(two_decodes):
    proxy, _, dead, alive = two_decodes
    for stream in (False, True, False, True):  # both decode nodes serve (round robin)
        assert _post(proxy.url, stream).status_code == 200
    legs_before = _legs_to(proxy.url, dead)
    dead.kill()  # SIGKILL: no goodbye, no more heartbeats
    # two streams first: round robin sends one of them to the dead node before anything else does
    kinds = (True, True, False, True, False, True, False, False)
    answers = [_post(proxy.url, stream) for stream in kinds]
    assert [r.status_code for r in answers] == [200] * 8, [r.text for r in answers if r.status_code != 200]
    assert all(b"[DONE]" in r.content for r, stream in zip(answers, kinds) if stream)  # streams ended normally
    assert httpx.get(proxy.url + "/ready").json()["nodes"]["D"] == 2  # not evicted: the cool-down did it
    # one leg went to the dead node (then ran elsewhere); without the cool-down, round robin sends it four
    assert _legs_to(proxy.url, dead) == legs_before + 1
    assert alive.popen.poll() is None


def _legs_to(proxy_url: str, node) -> float:
    text = httpx.get(proxy_url + "/metrics").text
    label = f'node="127.0.0.1:{node.port}"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:proxy_node_requests_total{") and label in line and 'role="decode"' in line)
