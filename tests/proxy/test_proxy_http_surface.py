"""The proxy's own HTTP surface against fake nodes: one error shape on every route, bounded
bodies, ids a client sees, the stream idle timeout, TTFT on content, no false 499."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.waiting import wait_for
from proxy.metrics import StreamWatch

BODY = {"model": "m", "prompt": "hi", "max_tokens": 5}


def _assert_openai_error(r: httpx.Response, status: int, code: str, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    assert error["code"] == code and error["param"] == param
    assert not isinstance(error["code"], int)
    return error


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("GET", "/v1/nope", 404, "unknown_url"),
    ("POST", "/v2/completions", 404, "unknown_url"),
    ("GET", "/v1/completions", 405, "method_not_allowed"),
    ("DELETE", "/v1/chat/completions", 405, "method_not_allowed"),
    ("POST", "/health", 405, "method_not_allowed"),
])
def test_unknown_paths_and_wrong_methods_get_the_openai_shape(make_cluster, method, path, status, code):
    c = make_cluster()
    _assert_openai_error(httpx.request(method, c.url + path), status, code)


@pytest.mark.parametrize(("content", "status", "code"), [
    (b"", 400, "missing_body"),
    (b"   ", 400, "missing_body"),
    (b"{not json", 400, "invalid_json"),
    (b"[1, 2]", 400, "invalid_body"),
    (b"[" * 3000, 400, "nesting_too_deep"),
    (b'{"prompt": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "nesting_too_deep"),
    (b'{"prompt": "' + b"x" * 5000 + b'"}', 413, "request_too_large"),
])
def test_bad_bodies_are_refused_before_any_node_sees_them(make_cluster, content, status, code):
    c = make_cluster(max_request_bytes=4096)
    r = httpx.post(f"{c.url}/v1/completions", content=content, headers={"content-type": "application/json"})
    _assert_openai_error(r, status, code, "body")
    assert not c.prefills[0].seen and not c.decodes[0].seen
    assert httpx.post(f"{c.url}/v1/completions", json=BODY).status_code == 200


def test_a_chunked_body_over_the_limit_is_413_while_reading(make_cluster):
    c = make_cluster(max_request_bytes=4096)

    def pieces():
        for _ in range(100):
            yield b"x" * 1000

    r = httpx.post(f"{c.url}/v1/completions", content=pieces(), headers={"content-type": "application/json"})
    _assert_openai_error(r, 413, "request_too_large", "body")


def test_brackets_inside_strings_do_not_count_as_nesting(make_cluster):
    c = make_cluster()
    r = httpx.post(f"{c.url}/v1/completions", json={**BODY, "prompt": "[" * 500 + '\\"{' * 100})
    assert r.status_code == 200, r.text


def test_unknown_model_is_404_model_not_found(make_cluster):
    c = make_cluster()
    r = httpx.post(f"{c.url}/v1/completions", json={**BODY, "model": "other"})
    _assert_openai_error(r, 404, "model_not_found", "model")
    assert r.headers["x-request-id"].startswith("cmpl-")  # refused before routing, still named


@pytest.mark.parametrize("stream", [False, True])
def test_client_request_id_is_echoed_and_the_tag_never_reaches_the_client(make_cluster, stream):
    c = make_cluster()
    c.decodes[0].behavior.after = tuple(c.prefills)  # as a real D: not done before its P has the request
    r = httpx.post(f"{c.url}/v1/completions", json={**BODY, "stream": stream},
                   headers={"X-Request-Id": "mine-1"})
    assert r.status_code == 200 and r.headers["x-request-id"] == "mine-1"
    assert c.decodes[0].seen[0].request_id.startswith("___prefill_addr_")  # the tag goes to the nodes only
    fresh = httpx.post(f"{c.url}/v1/chat/completions", json={"model": "m", "messages": []})
    assert fresh.headers["x-request-id"].startswith("chatcmpl-")
    assert "prefill_addr" not in fresh.headers["x-request-id"]


def test_errors_echo_the_client_request_id(make_cluster):
    c = make_cluster()
    r = httpx.post(f"{c.url}/v1/completions", content=b"{", headers={"X-Request-Id": "mine-2"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "mine-2"


def test_a_node_error_without_an_openai_body_gets_one(make_cluster):
    c = make_cluster()
    c.decodes[0].behavior.status, c.decodes[0].behavior.error_body = 500, b"Internal Server Error"
    r = httpx.post(f"{c.url}/v1/completions", json=BODY)
    error = _assert_openai_error(r, 500, "upstream_error")
    assert c.decodes[0].http_address in error["message"]


def test_a_silent_stream_is_ended_after_the_idle_timeout_and_both_legs_cancelled(make_cluster):
    c = make_cluster(stream_idle_timeout_s=0.5)
    c.decodes[0].behavior.chunk_delay_s = 30  # first chunk, then silence
    with httpx.stream("POST", f"{c.url}/v1/completions", json={**BODY, "stream": True}, timeout=20) as r:
        text = r.read().decode()
    events = [e for e in text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    error = json.loads(events[-2].removeprefix("data: "))["error"]
    assert error["code"] == "stream_idle_timeout" and c.decodes[0].http_address in error["message"]
    assert wait_for(lambda: c.decodes[0].seen[0].cancelled, timeout=5)
    metrics = httpx.get(f"{c.url}/metrics").text
    assert 'pdserve:proxy_errors_total{kind="stream_idle",role="proxy"} 1.0' in metrics


def test_a_stream_whose_headers_never_come_is_ended_after_the_idle_timeout(make_cluster):
    c = make_cluster(stream_idle_timeout_s=0.5)
    c.decodes[0].behavior.delay_s = 30  # a stopped node: it accepted the connection, says nothing
    r = httpx.post(f"{c.url}/v1/completions", json={**BODY, "stream": True}, timeout=20)
    error = _assert_openai_error(r, 504, "stream_idle_timeout")
    assert c.decodes[0].http_address in error["message"]
    assert wait_for(lambda: c.decodes[0].seen[0].cancelled, timeout=5)


def test_ttft_times_the_first_content_not_the_role_chunk(make_cluster):
    c = make_cluster()
    role = b'data: {"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
    content = b'data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}\n\n'
    c.decodes[0].behavior.chunks = [role, content, b"data: [DONE]\n\n"]
    c.decodes[0].behavior.chunk_delay_s = 0.3  # the content comes 0.3 s after the role chunk
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with httpx.stream("POST", f"{c.url}/v1/chat/completions", json=body) as r:
        r.read()

    def ttft_sum() -> float:
        text = httpx.get(f"{c.url}/metrics").text
        name = "pdserve:time_to_first_token_seconds_sum"
        line = next(ln for ln in text.splitlines() if ln.startswith(name))
        return float(line.rsplit(" ", 1)[1])

    assert wait_for(lambda: ttft_sum() > 0)
    assert ttft_sum() >= 0.3  # a bound, not a timing: the content cannot have come sooner


def test_a_client_that_leaves_right_after_done_is_counted_as_200(make_cluster):
    c = make_cluster()
    c.decodes[0].behavior.chunk_delay_s = 0.5  # the node holds the stream open after [DONE]
    with httpx.stream("POST", f"{c.url}/v1/completions", json={**BODY, "stream": True}) as r:
        for line in r.iter_lines():
            if line == "data: [DONE]":
                break  # and hang up, as benchmark clients do

    def count(status: str) -> str:
        return f'pdserve:proxy_requests_total{{role="proxy",status="{status}"}} 1.0'

    assert wait_for(lambda: count("200") in httpx.get(f"{c.url}/metrics").text, timeout=5)
    assert count("499") not in httpx.get(f"{c.url}/metrics").text


def test_stream_watch_finds_content_and_done_across_split_reads():
    watch = StreamWatch()
    assert not watch.feed(b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n')
    assert not watch.feed(b'data: {"choices":[{"index":0,"te')
    assert watch.feed(b'xt":"Hel"}]}\n\n')
    assert not watch.feed(b'data: {"choices":[{"index":0,"text":"lo"}]}\n\ndata: [DO')
    assert not watch.done
    watch.feed(b"NE]\n\n")
    assert watch.done


@pytest.mark.parametrize("stream", [False, True])
def test_a_failure_is_logged_with_the_request_ids_and_the_node(make_cluster, caplog, stream):
    c = make_cluster()
    c.decodes[0].behavior.status = 500
    with caplog.at_level("INFO", logger="proxy.relay"):
        r = httpx.post(f"{c.url}/v1/completions", json={**BODY, "stream": stream},
                       headers={"X-Request-Id": "client-9"})
        assert r.status_code == 500
        tag = c.decodes[0].seen[0].request_id
        assert wait_for(lambda: any(tag in rec.getMessage() for rec in caplog.records))
    line = next(rec for rec in caplog.records if tag in rec.getMessage())
    message = line.getMessage()
    assert line.levelname == "WARNING"
    assert "cmpl-" + tag.rsplit("_", 1)[1] in message and "client_id=client-9" in message
    assert f"D={c.decodes[0].http_address}" in message and "status=500" in message
    assert f"decode node {c.decodes[0].http_address} answered 500" in message
