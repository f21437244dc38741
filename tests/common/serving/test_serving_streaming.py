"""SSE streams: chunk shapes, [DONE], include_usage, engine errors, and abort on disconnect."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient
from serving_fakes import CharTokenizer, FakeEngine

from common.config import NodeConfig
from common.metrics import NodeMetrics
from common.serving.app import build_app
from helpers.ports import free_port
from helpers.waiting import wait_until


def _events(text: str) -> list[Any]:
    assert text.endswith("data: [DONE]\n\n"), text[-200:]
    blocks = [b for b in text.split("\n\n") if b]
    assert all(b.startswith("data: ") for b in blocks)
    return [json.loads(b[6:]) for b in blocks[:-1]]


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> TestClient:
    return TestClient(build_app(engine, CharTokenizer(), NodeConfig(), NodeMetrics("both")))


def test_completion_stream_chunks_then_done(client: TestClient) -> None:
    reply = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 3, "stream": True})
    assert reply.status_code == 200 and reply.headers["content-type"].startswith("text/event-stream")
    events = _events(reply.text)
    assert all(e["object"] == "text_completion" for e in events)
    assert "".join(e["choices"][0]["text"] for e in events) == "abc"
    assert [e["choices"][0]["finish_reason"] for e in events] == [None, None, None, "length"]
    assert all("usage" not in e for e in events)


def test_chat_stream_role_first_and_usage_last(client: TestClient) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    events = _events(client.post("/v1/chat/completions", json=body).text)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert [e["choices"][0]["delta"] for e in events[1:3]] == [{"content": "a"}, {"content": "b"}]
    assert events[3]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}
    assert events[4]["choices"] == [] and events[4]["usage"]["completion_tokens"] == 2
    assert all(e["object"] == "chat.completion.chunk" for e in events)


def test_multi_prompt_stream_interleaves_choices(client: TestClient) -> None:
    body = {"prompt": ["x", "y"], "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}}
    events = _events(client.post("/v1/completions", json=body).text)
    by_index: dict[int, str] = {}
    for e in events[:-1]:
        choice = e["choices"][0]
        by_index[choice["index"]] = by_index.get(choice["index"], "") + choice["text"]
    assert by_index == {0: "ab", 1: "ab"}
    assert events[-1]["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8,
                                   "prompt_tokens_details": {"cached_tokens": 0}}


def test_engine_error_in_stream_is_one_error_event_then_done(engine: FakeEngine, client: TestClient) -> None:
    engine.error, engine.error_after = "prefill node 10.0.0.1:14579 unreachable", 2
    events = _events(client.post("/v1/completions", json={"prompt": "x", "max_tokens": 5, "stream": True}).text)
    assert [e["choices"][0]["text"] for e in events[:2]] == ["a", "b"]
    assert events[2] == {"error": {"message": "prefill node 10.0.0.1:14579 unreachable", "type": "server_error",
                                   "param": None, "code": "engine_error"}}
    assert len(events) == 3


@pytest.fixture
def live_server(engine: FakeEngine) -> Iterator[tuple[str, NodeMetrics]]:
    """The app on a real uvicorn, so a client can really go away mid-stream."""
    metrics = NodeMetrics("both")
    port = free_port()
    config = uvicorn.Config(build_app(engine, CharTokenizer(), NodeConfig(), metrics), port=port, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "uvicorn started", 10)
        yield f"http://127.0.0.1:{port}", metrics
    finally:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_client_disconnect_aborts_the_request(
    engine: FakeEngine, live_server: tuple[str, NodeMetrics], path: str
) -> None:
    url, metrics = live_server
    engine.delay_s = 0.02
    body: dict[str, Any] = {"max_tokens": 40, "stream": True}
    body.update({"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]})
    with httpx.Client(timeout=10) as http:
        with http.stream("POST", url + path, json=body, headers={"X-Request-Id": "gone-1"}) as reply:
            assert reply.status_code == 200
            lines = reply.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
    wait_until(lambda: "gone-1" in engine.aborted, "the request aborted after the client left", 5)
    assert engine.stats().num_running == 0
    assert len(engine.calls) == 1
    text = httpx.get(url + "/metrics").text
    assert 'pdserve:num_requests_running{role="both"} 0.0' in text
    assert 'pdserve:request_errors_total{kind="aborted",role="both"} 1.0' in text


def test_engine_refusal_is_a_400_not_a_500(engine: FakeEngine, client: TestClient) -> None:
    engine.running.add("dup")  # the id is already running in the engine
    headers = {"X-Request-Id": "dup"}
    reply = client.post("/v1/completions", json={"prompt": "x"}, headers=headers)
    assert reply.status_code == 400 and "already running" in reply.json()["error"]["message"]
    streamed = client.post("/v1/completions", json={"prompt": "x", "stream": True}, headers=headers)
    (event,) = _events(streamed.text)
    assert "already running" in event["error"]["message"]
    assert engine.aborted == [] and "dup" in engine.running  # the running request was left alone


def test_token_id_notes_only_for_whoever_asks_and_resume_ids_only_under_a_tag(client: TestClient,
                                                                            engine: FakeEngine) -> None:
    """A stream carries ``: pdserve-ids`` comment lines only when the request asked for them (our
    proxy's migration does); anyone else, vLLM's proxy included, gets the usual bytes. The resume
    field is refused on an untagged request."""
    body = {"prompt": "x", "max_tokens": 3, "stream": True}
    noted = client.post("/v1/completions", json=body, headers={"x-pdserve-token-ids": "1"}).text
    assert noted.count(": pdserve-ids 0 ") == 3
    plain = client.post("/v1/completions", json=body).text
    stripped = "".join(line for line in noted.splitlines(keepends=True) if not line.startswith(": pdserve-ids"))
    assert "pdserve-ids" not in plain
    assert [e["choices"] for e in _events(plain)] == [e["choices"] for e in _events(stripped)]
    refused = client.post("/v1/completions", json={**body, "pdserve_resume_token_ids": [5]})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "pdserve_resume_token_ids"
