"""A daemon's in-place role flip (issue 36 item 1, common/node/role_flip.py), against real processes:
a keyed proxy, two prefill daemons and one decode daemon, and a colocated node whose greedy answers
are the reference. Flips under load lose no request and change no answer; a stale epoch gets 409;
a leg sent to a node that no longer has its role gets 409 and the proxy runs it elsewhere; a drain
that runs out of time ends the rest and the proxy migrates them; the admin call needs the cluster key."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import httpx
import pytest

from common.cluster_auth import ClusterKey, admin_headers
from helpers.cluster import Proc, labelled, metric, start, stop_all
from helpers.flippable import flip, role_epoch, start_flippable
from helpers.waiting import wait_for

PROMPTS = ["The quick brown fox", "Once upon a time", "A B C D E F G", "In the beginning there was"]
SHORT = 12  # tokens per answer under load: long enough to be running when a flip comes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("role_flip")
    key_file = ClusterKey.generate(tmp / "cluster.key")
    keyed = ("--cluster-key-file", str(key_file))
    procs: dict[str, Proc] = {}
    try:
        proxy = procs["proxy"] = start("proxy", tmp, *keyed, "--migration-limit", "3", wait=False)
        node = (*keyed, "--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5")
        procs["p1"] = start_flippable("prefill", tmp, *node, name="p1")
        procs["p2"] = start_flippable("prefill", tmp, *node, name="p2")
        # the only node whose drain runs out at once: a long stream on it is migrated at its flip
        procs["d1"] = start_flippable("decode", tmp, *node, "--drain-timeout-s", "0.2", name="d1")
        procs["both"] = start("both", tmp, name="both", wait=False)
        for proc in procs.values():
            proc.wait_ready()
        _until(lambda: _registered(proxy) == {"P": 2, "D": 1}, 20, "the proxy to see 2 prefill and 1 decode nodes")
        yield procs, ClusterKey.load(key_file), tmp
    finally:
        stop_all(procs.values())


def _until(predicate, timeout: float, what: str) -> None:
    assert wait_for(predicate, timeout), f"timed out waiting for {what}"


def _registered(proxy: Proc) -> dict:
    return httpx.get(proxy.url + "/ready", timeout=5).json().get("nodes", {})


def _flip_ok(node: Proc, key: ClusterKey, role: str) -> dict:
    r = flip(node, key, role)
    assert r.status_code == 200, r.text
    assert r.json()["role"] == role
    return r.json()


def _complete(url: str, prompt: str, max_tokens: int, stream: bool) -> str:
    """The answer's text; raises on any error (status or error event)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
    return "".join(text)


class Load:
    """Clients sending the prompts through the proxy until stopped; every answer checked against
    the colocated node's."""

    def __init__(self, proxy: Proc, reference: dict[str, str], clients: int = 4) -> None:
        self.proxy, self.reference = proxy, reference
        self.stop, self.done, self.failures = threading.Event(), 0, []
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def _run(self, i: int) -> None:
        n = i
        while not self.stop.is_set():
            prompt, stream = PROMPTS[n % len(PROMPTS)], n % 2 == 0
            try:
                text = _complete(self.proxy.url, prompt, SHORT, stream)
                if text != self.reference[prompt]:
                    self.failures.append(f"{prompt!r}: {text!r} != {self.reference[prompt]!r}")
            except Exception as exc:  # noqa: BLE001 - every failure is reported by the test
                self.failures.append(f"{prompt!r} (stream={stream}): {exc}")
            self.done += 1
            n += 1

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


@pytest.fixture(scope="module")
def reference(cluster) -> dict[str, str]:
    procs, _, _ = cluster
    return {p: _complete(procs["both"].url, p, SHORT, False) for p in PROMPTS}


def test_flip_each_way_under_load_loses_nothing(cluster, reference) -> None:
    procs, key, _ = cluster
    proxy, p2 = procs["proxy"], procs["p2"]
    with Load(proxy, reference) as load:
        _until(lambda: load.done >= 4, 30, "requests to flow")
        to_decode = _flip_ok(p2, key, "decode")
        _until(lambda: _registered(proxy) == {"P": 1, "D": 2}, 10, "the proxy to see p2 as a decode node")
        seen = load.done
        _until(lambda: load.done >= seen + 8, 30, "requests through the flipped node")
        to_prefill = _flip_ok(p2, key, "prefill")
        _until(lambda: _registered(proxy) == {"P": 2, "D": 1}, 10, "the proxy to see p2 as a prefill node")
        seen = load.done
        _until(lambda: load.done >= seen + 8, 30, "requests after the flip back")
    assert load.failures == []
    assert (to_decode["epoch"], to_prefill["epoch"]) == (to_prefill["epoch"] - 1, to_decode["epoch"] + 1)
    assert to_decode["aborted"] == to_prefill["aborted"] == 0  # drained, nothing cut short
    for src, dst in (("prefill", "decode"), ("decode", "prefill")):
        assert labelled(p2.url, "pdserve:role_flips_total", **{"from": src, "to": dst, "outcome": "ok"}) >= 1
    assert labelled(p2.url, "pdserve:node_role", role="prefill") == 1
    assert labelled(p2.url, "pdserve:node_role", role="decode") == 0
    assert metric(p2.url, "pdserve:role_flip_seconds_count") >= 2


def test_stale_epoch_is_refused(cluster) -> None:
    procs, key, _ = cluster
    p1 = procs["p1"]
    epoch = role_epoch(p1)
    r = flip(p1, key, "decode", epoch + 5)
    assert r.status_code == 409
    body = r.json()
    assert body["error"]["code"] == "stale_role_epoch"
    assert (body["role"], body["epoch"], body["state"]) == ("prefill", epoch, "serving")
    assert f"role epoch {epoch}" in body["error"]["message"]
    assert role_epoch(p1) == epoch  # nothing changed
    r = flip(p1, key, "prefill", epoch)  # the role it has: nothing to do
    assert r.status_code == 200 and r.json()["epoch"] == epoch


def test_a_leg_for_a_stale_role_is_retried_elsewhere(cluster, reference) -> None:
    """Proxies that list p2 statically (no heartbeat corrects them) in the role it no longer has: each
    leg sent to it gets 409 naming the node's role and epoch, and the proxy runs the request on another
    node (a decode leg by migration, a prefill leg by its retry); every answer is the colocated one."""
    procs, key, tmp = cluster
    p1, p2, d1 = procs["p1"], procs["p2"], procs["d1"]

    def entry(node: Proc) -> str:
        return f"127.0.0.1:{node.port}@{node.kv_addr}@pdserve-tiny"

    common = ("--cluster-key-file", str(tmp / "cluster.key"), "--policy", "round_robin", "--migration-limit", "3")
    # p2 as a decode node while it is prefill; p2 as a prefill node once it became decode
    as_decode = start("proxy", tmp, *common, "--static-prefill", entry(p1), "--static-decode", entry(d1), entry(p2),
                      name="p2-as-decode", wait=False)
    as_prefill = start("proxy", tmp, *common, "--static-prefill", entry(p1), entry(p2), "--static-decode", entry(d1),
                       name="p2-as-prefill", wait=False)
    try:
        for proxy in (as_decode, as_prefill):
            proxy.wait_ready()
        for i in range(6):
            prompt = PROMPTS[i % len(PROMPTS)]
            assert _complete(as_decode.url, prompt, SHORT, i % 2 == 0) == reference[prompt]
        assert labelled(as_decode.url, "pdserve:proxy_migrations_total", cause="decode_error") >= 1
        assert "the request was a decode leg" in p2.log.read_text()
        _flip_ok(p2, key, "decode")
        for i in range(6):
            prompt = PROMPTS[i % len(PROMPTS)]
            assert _complete(as_prefill.url, prompt, SHORT, i % 2 == 0) == reference[prompt]
        assert metric(as_prefill.url, "pdserve:proxy_prefill_retries_total") >= 1
        assert "is now a decode node" in p2.log.read_text()
    finally:
        stop_all([as_decode, as_prefill])
        if role_epoch(p2) % 2:  # started as prefill: an odd epoch is decode
            _flip_ok(p2, key, "prefill")


def test_a_drain_that_runs_out_migrates_the_rest(cluster) -> None:
    """d1 (--drain-timeout-s 0.2) flips while a long stream runs on it: the stream is ended there and
    resumed on p2 (flipped to decode first); the client's answer is the colocated node's, whole."""
    procs, key, _ = cluster
    proxy, p2, d1, both = procs["proxy"], procs["p2"], procs["d1"], procs["both"]
    long_tokens = 400
    expected = _complete(both.url, PROMPTS[0], long_tokens, False)
    answers: list[str] = []
    streamer = threading.Thread(target=lambda: answers.append(_complete(proxy.url, PROMPTS[0], long_tokens, True)))
    streamer.start()
    _until(lambda: labelled(d1.url, "pdserve:num_requests_running") >= 1, 20, "the stream to run on d1")  # the only decode node
    _flip_ok(p2, key, "decode")  # somewhere to migrate to
    _until(lambda: _registered(proxy) == {"P": 1, "D": 2}, 10, "two decode nodes")
    flipped = _flip_ok(d1, key, "prefill")
    streamer.join(timeout=120)
    try:
        assert flipped["aborted"] >= 1, flipped  # the drain ran out with the stream still on d1
        assert answers == [expected]
        assert labelled(proxy.url, "pdserve:proxy_migrations_total", cause="decode_error") >= 1
    finally:
        _flip_ok(d1, key, "decode")
        _flip_ok(p2, key, "prefill")
        _until(lambda: _registered(proxy) == {"P": 2, "D": 1}, 10, "the cluster as it began")


def test_the_admin_call_needs_the_cluster_key_and_a_good_body(cluster, tmp_path: Path) -> None:
    procs, key, _ = cluster
    p1, both = procs["p1"], procs["both"]
    epoch = role_epoch(p1)
    body = json.dumps({"role": "decode", "epoch": epoch}).encode()
    url = p1.url + "/admin/role"
    r = httpx.post(url, content=body, timeout=10)
    assert r.status_code == 401 and r.json()["error"]["code"] == "unauthorized"
    other = ClusterKey.load(ClusterKey.generate(tmp_path / "other.key"))
    r = httpx.post(url, content=body, headers=admin_headers(other, body), timeout=10)
    assert r.status_code == 403
    r = httpx.post(url, content=json.dumps({"role": "decode", "epoch": epoch + 1}).encode(),
                   headers=admin_headers(key, body), timeout=10)
    assert r.status_code == 403 and "body" in r.json()["error"]["message"]  # signed for another body
    once = b'{"role": "both", "epoch": 0}'
    signed = admin_headers(key, once)
    assert httpx.post(url, content=once, headers=signed, timeout=10).status_code == 400
    r = httpx.post(url, content=once, headers=signed, timeout=10)
    assert r.status_code == 403 and "already used" in r.json()["error"]["message"]  # one use per signature
    for bad, param in ((b"not json", None), (b"[1]", None), (b'{"role": "both", "epoch": 0}', "role"),
                       (b'{"role": "decode", "epoch": -1}', "epoch"), (b'{"role": "decode", "epoch": "0"}', "epoch"),
                       (b'{"role": "decode", "epoch": 0, "now": true}', "now")):
        r = httpx.post(url, content=bad, headers=admin_headers(key, bad), timeout=10)
        assert r.status_code == 400, (bad, r.text)
        assert r.json()["error"]["code"] == "invalid_role_request" and r.json()["error"]["param"] == param
    assert role_epoch(p1) == epoch
    r = httpx.post(both.url + "/admin/role", json={"role": "decode", "epoch": 0}, timeout=10)
    assert r.status_code == 409 and r.json()["error"]["code"] == "role_flip_unsupported"
