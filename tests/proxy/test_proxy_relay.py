"""The proxy against fake nodes over real HTTP: tagging, dispatch order, relay, errors."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from proxy_fakes import SSE_CHUNKS

from helpers.ports import free_port
from helpers.waiting import wait_for
from proxy.config import parse_static_node

TAGGED = re.compile(r"^___prefill_addr_(.*):(\d+)___decode_addr_(.*):(\d+)_([0-9a-f]{32})$")
BODY = {"model": "m", "prompt": "hi", "max_tokens": 5}


def test_tagged_id_reaches_both_legs_identically(make_cluster):
    c = make_cluster()
    c.decodes[0].behavior.delay_s = 0.2  # a real D cannot answer before P's leg has arrived
    r = httpx.post(f"{c.url}/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    p_seen, d_seen = c.prefills[0].seen[0], c.decodes[0].seen[0]
    assert p_seen.request_id == d_seen.request_id
    m = TAGGED.match(p_seen.request_id)
    # the client sees cmpl-<the tag's uuid>, never the routing tag
    assert r.headers["x-request-id"] == "cmpl-" + p_seen.request_id.rsplit("_", 1)[1]
    assert m and f"{m[1]}:{m[2]}" == c.kv_of["p0"] and f"{m[3]}:{m[4]}" == c.kv_of["d0"]
    # P gets a one-token non-stream request, D the client's own body.
    assert p_seen.body["max_tokens"] == 1 and p_seen.body["stream"] is False
    assert d_seen.body == BODY
    assert r.json()["node"] == "d0"


def test_chat_prefill_leg_limits_completion_tokens(make_cluster):
    c = make_cluster()
    c.decodes[0].behavior.delay_s = 0.2  # else D may finish first and the P leg be cancelled unseen
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True,
            "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{c.url}/v1/chat/completions", json=body) as r:
        r.read()
    p_body = c.prefills[0].seen[0].body
    assert p_body["max_completion_tokens"] == 1 and p_body["max_tokens"] == 1
    assert p_body["stream"] is False and "stream_options" not in p_body
    assert c.decodes[0].seen[0].body == body


def test_sse_is_relayed_byte_identical_and_chunk_by_chunk(make_cluster):
    c = make_cluster()
    c.decodes[0].behavior.chunk_delay_s = 0.05
    pieces = []
    with httpx.stream("POST", f"{c.url}/v1/completions", json={**BODY, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for piece in r.iter_raw():
            pieces.append(piece)
    assert b"".join(pieces) == b"".join(SSE_CHUNKS)
    assert len(pieces) >= 3  # arrived separately, not as one buffered answer


@pytest.mark.parametrize("dispatch", ["concurrent", "prefill_first"])
def test_dispatch_order(make_cluster, dispatch):
    c = make_cluster(dispatch=dispatch)
    c.prefills[0].behavior.delay_s = 0.3
    c.decodes[0].behavior.delay_s = 0.4  # a real D cannot answer before P's KV arrives
    assert httpx.post(f"{c.url}/v1/completions", json=BODY).status_code == 200
    p_seen, d_seen = c.prefills[0].seen[0], c.decodes[0].seen[0]
    if dispatch == "concurrent":
        assert d_seen.arrived < p_seen.finished
    else:
        assert d_seen.arrived >= p_seen.finished


@pytest.mark.parametrize("leg", ["P", "D"])
@pytest.mark.parametrize("stream", [False, True])
def test_node_error_reaches_client_with_its_status_and_body(make_cluster, leg, stream):
    c = make_cluster()
    node = c.prefills[0] if leg == "P" else c.decodes[0]
    node.behavior.status = 400
    c.decodes[0].behavior.delay_s = 0.2 if leg == "P" else 0.0  # a real D waits for P's KV
    node.behavior.error_body = (b'{"error":{"message":"prompt too long","type":"invalid_request_error",'
                                b'"param":"prompt","code":"context_length_exceeded"}}')
    r = httpx.post(f"{c.url}/v1/completions", json={**BODY, "stream": stream})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == "prompt too long"


def test_non_openai_error_is_wrapped(make_cluster):
    c = make_cluster()
    c.decodes[0].behavior.status = 500
    c.decodes[0].behavior.error_body = b"Internal Server Error"
    r = httpx.post(f"{c.url}/v1/completions", json=BODY)
    assert r.status_code == 500
    assert "Internal Server Error" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_prefill_failure_cancels_decode_leg(make_cluster, stream):
    c = make_cluster()
    c.prefills[0].behavior.delay_s = 0.3
    c.prefills[0].behavior.status = 500
    c.decodes[0].behavior.delay_s = 5.0  # D waits for KV that never comes
    r = httpx.post(f"{c.url}/v1/completions", json={**BODY, "stream": stream}, timeout=10)
    assert r.status_code == 500 and r.json()["error"]["message"] == "fake failure"
    assert wait_for(lambda: c.decodes[0].seen and c.decodes[0].seen[0].cancelled, timeout=3)


def test_prefill_failure_after_stream_began_sends_sse_error(make_cluster):
    c = make_cluster()
    c.prefills[0].behavior.delay_s = 0.3
    c.prefills[0].behavior.status = 500
    c.decodes[0].behavior.chunk_delay_s = 0.2  # D's first bytes go out before P fails
    with httpx.stream("POST", f"{c.url}/v1/completions", json={**BODY, "stream": True}, timeout=10) as r:
        assert r.status_code == 200
        text = r.read().decode()
    assert text.startswith(SSE_CHUNKS[0].decode())
    events = [json.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {\"error\"")]
    assert events and "fake failure" in events[0]["error"]["message"]
    assert text.endswith("data: [DONE]\n\n")
    assert wait_for(lambda: c.decodes[0].seen[0].cancelled, timeout=3)


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_cancels_both_legs(make_cluster, stream):
    c = make_cluster()
    c.prefills[0].behavior.delay_s = 5.0
    c.decodes[0].behavior.chunk_delay_s = 5.0  # stream: first chunk sent, then D stalls
    if not stream:
        c.decodes[0].behavior.delay_s = 5.0
    with httpx.Client(timeout=10) as client:
        if stream:
            with client.stream("POST", f"{c.url}/v1/completions", json={**BODY, "stream": True}) as r:
                next(r.iter_raw())
        else:
            with pytest.raises(httpx.ReadTimeout):
                client.post(f"{c.url}/v1/completions", json=BODY, timeout=0.5)
    assert wait_for(lambda: c.prefills[0].seen and c.prefills[0].seen[0].cancelled, timeout=3)
    assert wait_for(lambda: c.decodes[0].seen and c.decodes[0].seen[0].cancelled, timeout=3)


@pytest.mark.parametrize("refusal", ["503", "unreachable"])
def test_refusing_prefill_is_retried_on_another(make_cluster, refusal):
    c = make_cluster(n_prefill=2)
    c.decodes[0].behavior.delay_s = 0.5  # a real D waits for P's KV, so the first D leg is still open (wide: CI may be slow)
    good = c.prefills[1:]
    if refusal == "503":
        c.prefills[0].behavior.status = 503
    else:  # a registered P whose port nothing listens on
        good = c.prefills
        entry = f"127.0.0.1:{free_port()}@10.9.9.9:1@m@fp"
        c.app.state.registry.register(parse_static_node(entry, "P"), static=True)
    for _ in range(4):  # round robin meets the bad node within these
        r = httpx.post(f"{c.url}/v1/completions", json=BODY)
        assert r.status_code == 200, r.text
    good_ids = {s.request_id for node in good for s in node.seen}
    served = [s.request_id for s in c.decodes[0].seen if not s.cancelled]
    assert len(served) == 4 and set(served) <= good_ids  # the retried D leg carried the new P's id
    assert wait_for(lambda: sum(s.cancelled for s in c.decodes[0].seen) >= 1)  # the first D leg was dropped
    assert re.search(rb"pdserve:proxy_prefill_retries_total\{role=\"proxy\"\} [1-9]",
                     httpx.get(f"{c.url}/metrics").content)



def test_after_a_second_prefill_failure_the_decode_node_computes_the_prompt(make_cluster):
    """Retried once on another prefill node; a second failure (a third node never tried) sends
    the request to its decode node with the local-prefill tag: a 200, not an error."""
    c = make_cluster(n_prefill=3)
    c.decodes[0].behavior.delay_s = 0.5  # a real D waits for P's KV, so the first D leg is still open
    for node in c.prefills:
        node.behavior.status = 503
    r = httpx.post(f"{c.url}/v1/completions", json=BODY)
    assert r.status_code == 200, r.text
    assert sum(len(node.seen) for node in c.prefills) == 2
    served = [s.request_id for s in c.decodes[0].seen if not s.cancelled]
    assert len(served) == 1 and served[0].startswith("___prefill_addr_local:0___")
    assert re.search(rb'pdserve:proxy_prefill_decisions_total\{[^}]*path="local"[^}]*reason="prefill_failed"[^}]*\} 1',
                     httpx.get(f"{c.url}/metrics").content)

def test_api_key(make_cluster):
    c = make_cluster(api_key="s3cret")
    assert httpx.post(f"{c.url}/v1/completions", json=BODY).status_code == 401
    bad = httpx.post(f"{c.url}/v1/completions", json=BODY, headers={"Authorization": "Bearer nope"})
    assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key"
    ok = httpx.post(f"{c.url}/v1/completions", json=BODY, headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200
    assert httpx.get(f"{c.url}/health").status_code == 200  # ops routes stay open


def test_bad_json_is_400(make_cluster):
    c = make_cluster()
    r = httpx.post(f"{c.url}/v1/completions", content=b"{nope")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
