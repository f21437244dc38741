"""``--api-key`` (issue 22): checked before the body is read, the scheme in any case, and
``/metrics`` (which names the nodes' internal addresses) behind it too."""

from __future__ import annotations

import socket

import httpx

BODY = {"model": "m", "prompt": "hi", "max_tokens": 3}
KEY = "s3cret"


def test_a_request_without_the_key_is_refused_before_its_body_is_read(make_cluster):
    c = make_cluster(api_key=KEY)
    with socket.create_connection(("127.0.0.1", c.proxy.port), timeout=10) as sock:
        # announces 4 MiB and sends 10 bytes: a proxy that reads the body first never answers
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 4000000\r\n\r\n{\"prompt\":")
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 401"), head
    assert b"invalid_api_key" in head


def test_the_bearer_scheme_is_case_insensitive(make_cluster):
    c = make_cluster(api_key=KEY)
    for scheme in ("Bearer", "bearer", "BEARER"):
        r = httpx.post(f"{c.url}/v1/completions", json=BODY, headers={"Authorization": f"{scheme} {KEY}"})
        assert r.status_code == 200, (scheme, r.text)
    for header in (f"Basic {KEY}", KEY, "Bearer", f"Bearer {KEY}x"):
        r = httpx.post(f"{c.url}/v1/completions", json=BODY, headers={"Authorization": header})
        assert r.status_code == 401, header


def test_metrics_name_node_addresses_only_to_key_holders(make_cluster):
    c = make_cluster(api_key=KEY)
    httpx.post(f"{c.url}/v1/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"})
    anonymous = httpx.get(f"{c.url}/metrics")
    assert anonymous.status_code == 401 and c.prefills[0].http_address not in anonymous.text
    allowed = httpx.get(f"{c.url}/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert allowed.status_code == 200 and c.prefills[0].http_address in allowed.text
    assert httpx.get(f"{c.url}/health").status_code == 200
    assert httpx.get(f"{c.url}/ready").status_code == 200
