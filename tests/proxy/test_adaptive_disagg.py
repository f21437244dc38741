"""Adaptive disaggregation through real processes: proxy (auto) + prefill + decode + colocated,
plus two proxies over the same daemons with ``--disagg-policy always`` and ``never``.

Under ``auto`` a short prompt is prefilled on the decode node (no prefill leg, no KV moved) and
a long one, while the decode node runs a stream its local prefill would hold up, on the prefill
node (KV moved), asserted on the proxy's decision counter and the decode node's
transfer bytes; the answers (greedy with logprobs, and seeded sampling) are the same on
every path and on the colocated node (logprobs to float32 rounding: a prefix one node has
cached is computed in other chunks than on a node computing it fresh).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator

import httpx
import pytest
from pydoc_data.topics import topics

from helpers.cluster import Proc, all_ready, metric, start, static_nodes
from helpers.waiting import wait_until

SHORT = "What does the with statement do?"
LONG = " ".join(topics.values())[:9000]  # ~2,500 tokens: past the decode node's 50 ms stall bound
MEDIUM = " ".join(topics.values())[20000:21500]  # ~400 tokens: a timed prefill on the prefill node


@pytest.fixture(scope="module")
def policy_proxies(session_cluster: dict[str, Proc], tmp_path_factory: pytest.TempPathFactory
                   ) -> Iterator[dict[str, Proc]]:
    """``always`` and ``never`` proxies of this module's own over the shared daemons (the shared
    registry proxy is the ``auto`` one: it needs the heartbeats' measured rates)."""
    tmp = tmp_path_factory.mktemp("adaptive")
    others = {policy: start("proxy", tmp, *static_nodes(session_cluster), "--disagg-policy", policy,
                            name=f"proxy-{policy}", wait=False) for policy in ("always", "never")}
    with all_ready(others):
        yield others


@pytest.fixture
def cluster(shared_cluster: dict[str, Proc], policy_proxies: dict[str, Proc]) -> dict[str, Proc]:
    return {**shared_cluster, **policy_proxies}


def _complete(proc: Proc, prompt: str, **extra) -> dict:
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            **extra}
    r = httpx.post(proc.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def _same_logprobs(got: dict | None, expected: dict | None) -> None:
    """Same tokens and top-token sets; values equal to float32 rounding (a prompt whose prefix one
    node has cached is computed in other chunks than on a node computing it fresh)."""
    if expected is None:
        assert got is None
        return
    assert got["tokens"] == expected["tokens"]
    assert got["token_logprobs"] == pytest.approx(expected["token_logprobs"], abs=1e-4)
    for g, e in zip(got["top_logprobs"], expected["top_logprobs"], strict=True):
        assert g.keys() == e.keys() and list(g.values()) == pytest.approx(list(e.values()), abs=1e-4)


def _decisions(proc: Proc, path: str) -> dict[str, float]:
    """``{reason: count}`` of the proxy's decisions for ``path``."""
    out = {}
    for line in httpx.get(proc.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve:proxy_prefill_decisions_total{") and f'path="{path}"' in line:
            reason = line.split('reason="', 1)[1].split('"', 1)[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def _kv_bytes(proc: Proc) -> float:
    text = httpx.get(proc.url + "/metrics", timeout=5).text
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("pdserve:kv_transfer_bytes_total{"))


def test_auto_prefills_a_short_prompt_locally_and_a_long_one_remotely(cluster) -> None:
    proxy, decode = cluster["proxy"], cluster["decode"]
    _complete(proxy, MEDIUM)  # nothing measured yet: remote, and the prefill node times its prefill

    def measured() -> bool:  # a heartbeat carried the measured rate: a short prompt is prefilled locally
        if sum(_decisions(proxy, "local").values()) > 0:
            return True
        _complete(proxy, SHORT)
        return False

    wait_until(measured, "a short prompt prefilled locally", 60, step=0.2)

    local, moved = _decisions(proxy, "local"), _kv_bytes(decode)
    _complete(proxy, SHORT)
    assert _decisions(proxy, "local")["cheaper_local"] == local["cheaper_local"] + 1
    assert _kv_bytes(decode) == moved  # no transfer for a local prefill

    # A long prompt goes remote when its local prefill (past the decode node's 50 ms stall bound)
    # would hold up what runs there: a stream of this proxy's decoding on D. On an idle D local is
    # right (no hand-off to pay; equal rates here), so the test makes D busy instead of hoping it is.
    stop = threading.Event()

    def busy() -> None:
        body = {"model": "pdserve-tiny", "prompt": SHORT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=120) as r:
            for _ in r.iter_lines():
                if stop.is_set():
                    return

    streaming = threading.Thread(target=busy, daemon=True)
    streaming.start()
    try:
        wait_until(lambda: metric(decode.url, "pdserve:num_requests_running") >= 1, "a stream decodes on D", 60)
        remote = sum(_decisions(proxy, "remote").values())
        # a salt of its own: no test before this one in the shared cluster has this prompt in a cache
        # (one had in a CI run: LONG went local, est_local 0.2 ms, rightly)
        _complete(proxy, LONG, cache_salt=uuid.uuid4().hex)
    finally:
        stop.set()
        streaming.join(60)
    assert sum(_decisions(proxy, "remote").values()) == remote + 1  # stall_bound, or cheaper_remote: D is busy
    assert _kv_bytes(decode) > moved  # the long prompt's KV came from the prefill node
    assert "prefill local (cheaper_local)" in proxy.log.read_text(errors="replace")  # logged at debug


def test_every_policy_gives_the_colocated_answer(cluster) -> None:
    for prompt in (SHORT, LONG):
        for extra in ({"logprobs": 3}, {"temperature": 0.9, "seed": 11, "max_tokens": 12}):
            expected = _complete(cluster["both"], prompt, **extra)
            for name in ("proxy", "always", "never"):
                got = _complete(cluster[name], prompt, **extra)
                assert got["text"] == expected["text"], (name, prompt[:20], extra)
                _same_logprobs(got["logprobs"], expected["logprobs"])
    assert sum(_decisions(cluster["always"], "local").values()) == 0
    assert sum(_decisions(cluster["never"], "remote").values()) == 0
