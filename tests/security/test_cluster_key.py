"""With a cluster key (issue 11, "what was seen" 2, 3 and 4), against real processes: only
the proxy's signed ids are served, nothing is connected to for a refused id, strangers
cannot register, and the KV control plane answers members only."""

from __future__ import annotations

import json
import select
import socket

import httpx
import msgpack
import pytest

from common.cluster_auth import SIGNATURE_HEADER, ClusterKey, control_sealer, registry_sealer
from common.kv_transfer.messages import Ping, decode, encode
from common.request_id import make_request_id
from helpers.cluster import start, stop_all
from helpers.waiting import wait_for
from helpers.zmq_peer import raw_dealer

API_KEY = "client-secret"
BODY = {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("keyed")
    key_file = ClusterKey.generate(tmp / "cluster.key")
    keyed = ("--cluster-key-file", str(key_file))
    procs = []
    try:
        proxy = start("proxy", tmp, *keyed, "--api-key", API_KEY, "--heartbeat-timeout-s", "120", wait=False)
        procs.append(proxy)
        reg = f"127.0.0.1:{proxy.kv_port}"
        procs.append(start("prefill", tmp, *keyed, "--proxy", reg, wait=False))
        procs.append(start("decode", tmp, *keyed, "--proxy", reg, wait=False))
        for p in procs:
            p.wait_ready()
        yield ClusterKey.load(key_file), *procs
    finally:
        stop_all(procs)


class Listener:
    """A TCP port that records whether anything connected to it."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def connected_within(self, seconds: float) -> bool:
        return bool(select.select([self.sock], [], [], seconds)[0])

    def close(self) -> None:
        self.sock.close()


def _post(url: str, request_id: str | None, signature: str | bytes | None = None,
          body: dict = BODY) -> httpx.Response:
    headers = {}
    if request_id:
        headers["X-Request-Id"] = request_id
    if signature:
        headers[SIGNATURE_HEADER] = signature
    headers["Content-Type"] = "application/json"
    return httpx.post(f"{url}/v1/completions", content=_encoded(body), headers=headers, timeout=60)


def test_requests_through_the_proxy_are_served(cluster):
    _, proxy, _, _ = cluster
    r = httpx.post(f"{proxy.url}/v1/completions", json=BODY, timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_daemons_refuse_unsigned_forged_and_untagged_ids_and_connect_nowhere(cluster):
    key, _, prefill, decode = cluster
    trap = Listener()
    other = ClusterKey(b"not-this-cluster-key-0123456789")
    try:
        forged = make_request_id(trap.address, trap.address)
        for node in (prefill, decode):
            body = json.dumps(BODY).encode()
            cases = [(None, None), (forged, None), (forged, "v2.99999999999.00"),
                     (forged, other.sign_id(forged, node.name, body)),
                     (forged, key.sign_id(forged, node.name, body, ttl_s=-5)),  # untagged, unsigned, bad,
                     (forged, b"v2.99999999999.\xe9\xff")]  # foreign key, expired, bytes past ASCII (once a 500)
            for request_id, signature in cases:
                r = _post(node.url, request_id, signature)
                assert r.status_code == 403, (node.name, request_id, signature, r.text)
                err = r.json()["error"]
                assert err["type"] == "permission_error" and err["param"] == "X-Request-Id"
        assert not trap.connected_within(1.0), "a daemon connected to an address named in a refused id"
    finally:
        trap.close()


def test_a_signed_id_is_accepted_once(cluster):
    key, _, prefill, decode = cluster
    request_id = make_request_id(prefill.kv_addr, decode.kv_addr)  # D never asks: P's lease ends
    body = {**BODY, "max_tokens": 1}
    signature = key.sign_id(request_id, "prefill", _encoded(body))
    first = _post(prefill.url, request_id, signature, body)
    assert first.status_code == 200, first.text
    replay = _post(prefill.url, request_id, signature, body)
    assert replay.status_code == 403 and "already used" in replay.json()["error"]["message"]


def test_a_signature_is_good_for_one_role_one_node_and_one_body_only(cluster):
    """Issue 22, 2a: a signature made for the decode leg was accepted at prefill with another body."""
    key, _, prefill, decode = cluster
    request_id = make_request_id(prefill.kv_addr, decode.kv_addr)
    decode_signature = key.sign_id(request_id, "decode", _encoded(BODY))
    other_body = {**BODY, "prompt": "something else entirely", "max_tokens": 1}
    for body in (BODY, other_body):
        r = _post(prefill.url, request_id, decode_signature, body)  # the decode leg's signature at prefill
        assert r.status_code == 403 and "does not match" in r.json()["error"]["message"], r.text
    swapped = _post(prefill.url, request_id, key.sign_id(request_id, "prefill", _encoded(BODY)), other_body)
    assert swapped.status_code == 403 and "not the one" in swapped.json()["error"]["message"], swapped.text
    elsewhere = make_request_id("127.0.0.1:9", decode.kv_addr)  # signed for a prefill node that is not this one
    r = _post(prefill.url, elsewhere, key.sign_id(elsewhere, "prefill", _encoded(BODY)), BODY)
    assert r.status_code == 403 and "another prefill node" in r.json()["error"]["message"], r.text


def _encoded(body: dict) -> bytes:
    return json.dumps(body).encode()  # the exact bytes _post sends


def _registry_metric(proxy_url: str, reason: str) -> float:
    auth = {"Authorization": f"Bearer {API_KEY}"}  # /metrics names node addresses: behind the API key
    for line in httpx.get(f"{proxy_url}/metrics", headers=auth).text.splitlines():
        if line.startswith("pdserve:proxy_registry_rejected_total{") and f'reason="{reason}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0



def test_strangers_cannot_register(cluster):
    key, proxy, _, _ = cluster
    fake = {"type": "D", "http_address": "127.0.0.1:9", "zmq_address": "127.0.0.1:9"}
    with raw_dealer(f"127.0.0.1:{proxy.kv_port}") as dealer:
        dealer.send(msgpack.packb(fake))  # vLLM format, no seal
        stranger = registry_sealer(ClusterKey(b"a-stranger's-key-0123456789"))
        dealer.send_multipart(stranger.frames(msgpack.packb(fake)))
        assert wait_for(lambda: _registry_metric(proxy.url, "unauthenticated") >= 1
                        and _registry_metric(proxy.url, "bad_signature") >= 1, timeout=10, step=0.05)
        assert httpx.get(f"{proxy.url}/ready").json()["nodes"] == {"P": 1, "D": 1}
        sealed = registry_sealer(key).frames(msgpack.packb(fake))
        dealer.send_multipart(sealed)  # a member's seal registers the node once...
        dealer.send_multipart(sealed)  # ...and the same frame again is a replay
        assert wait_for(lambda: _registry_metric(proxy.url, "replayed") >= 1, timeout=10, step=0.05)
        # the member says goodbye for it, so no later request is routed there
        dealer.send_multipart(registry_sealer(key).frames(msgpack.packb({**fake, "goodbye": True})))
        assert wait_for(lambda: httpx.get(f"{proxy.url}/ready").json()["nodes"] == {"P": 1, "D": 1},
                        timeout=10, step=0.05)


def test_kv_control_plane_answers_members_only(cluster):
    key, _, prefill, _ = cluster
    with raw_dealer(prefill.kv_addr) as dealer:
        dealer.send(encode(Ping(id=7)))  # unsealed
        stranger = control_sealer(ClusterKey(b"a-stranger's-key-0123456789"))
        dealer.send_multipart(stranger.frames(encode(Ping(id=8))))
        assert not dealer.poll(1000), "the prefill node answered a stranger"
        dealer.send_multipart(control_sealer(key).frames(encode(Ping(id=9))))
        assert dealer.poll(10_000), "the prefill node did not answer a member"
        payload, reason = control_sealer(key).open(dealer.recv_multipart())
        assert reason is None and decode(payload).id == 9


def test_graceful_stop_says_goodbye(cluster):
    """Last: stops the decode node. The proxy (heartbeat timeout 120 s) drops it at once."""
    _, proxy, _, decode = cluster
    decode.stop()
    wait_for(lambda: httpx.get(f"{proxy.url}/ready").status_code == 503, timeout=15, step=0.05)
    assert httpx.get(f"{proxy.url}/ready").json()["error"]["message"].startswith("no compatible")
