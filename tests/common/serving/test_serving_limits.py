"""A node's bounded inputs and its one error shape: size, nesting, integers, Unicode, prompt
length before tokenizing, unknown routes; plus usage on every chunk when asked."""

from __future__ import annotations

import json
import threading

import pytest
from fastapi.testclient import TestClient
from serving_fakes import CharTokenizer, FakeEngine

from common.config import NodeConfig
from common.metrics import NodeMetrics
from common.serving.app import build_app
from common.serving.limits import json_depth_exceeds


class SpyTokenizer(CharTokenizer):
    """Records how many characters it tokenized and on which thread."""

    def __init__(self) -> None:
        self.encoded_chars = 0
        self.threads: set[str] = set()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded_chars += len(text)
        self.threads.add(threading.current_thread().name)
        return super().encode(text, add_special_tokens)


def _client(engine: FakeEngine | None = None, tokenizer: CharTokenizer | None = None, **config) -> TestClient:
    app = build_app(engine or FakeEngine(), tokenizer or CharTokenizer(), NodeConfig(**config),
                    NodeMetrics("both"))
    return TestClient(app)


def _error(reply, status: int) -> dict:
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(("method", "path", "status", "code"), [
    ("GET", "/v1/nothing", 404, "unknown_url"),
    ("POST", "/v1/embeddings", 404, "unknown_url"),
    ("GET", "/v1/completions", 405, "method_not_allowed"),
    ("DELETE", "/v1/models", 405, "method_not_allowed"),
])
def test_unknown_routes_and_methods_get_openai_errors(method: str, path: str, status: int, code: str) -> None:
    reply = _client().request(method, path)
    assert _error(reply, status)["code"] == code
    assert "detail" not in reply.json()
    if status == 405:
        assert "allow" in reply.headers


def test_a_body_over_the_limit_is_413_and_never_parsed() -> None:
    engine = FakeEngine()
    reply = _client(engine, max_request_bytes=2048).post("/v1/completions", json={"prompt": "x" * 4096})
    error = _error(reply, 413)
    assert error["code"] == "request_too_large" and error["param"] == "body" and "2048" in error["message"]
    assert not engine.calls


@pytest.mark.parametrize("raw", [b"[" * 3000, b'{"prompt": ' + b"[" * 65 + b"1" + b"]" * 65 + b"}"])
def test_deep_nesting_is_a_400(raw: bytes) -> None:
    reply = _client().post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert _error(reply, 400)["code"] == "nesting_too_deep"


def test_an_empty_body_names_the_body() -> None:
    reply = _client().post("/v1/completions", content=b"", headers={"content-type": "application/json"})
    error = _error(reply, 400)
    assert error["param"] == "body" and error["code"] == "missing_body" and "None" not in error["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"prompt": "x", "seed": 2**70}, "seed"),
    ({"prompt": "x", "max_tokens": 2**70}, "max_tokens"),
    ({"prompt": "x", "top_k": 2**70}, "top_k"),
    ({"prompt": "x", "logprobs": 2**70}, "logprobs"),
    ({"prompt": [2**70]}, "prompt"),
    ({"prompt": "x", "stop_token_ids": [2**70]}, "stop_token_ids"),
    ({"prompt": "\ud800"}, "prompt"),
    ({"prompt": "x", "stop": ["ok", "\udfff"]}, "stop"),
])
def test_out_of_range_integers_and_invalid_unicode_name_the_field(body: dict, param: str) -> None:
    raw = json.dumps(body).encode()  # json escapes the surrogate as \ud800, as a client would send it
    client = _client()
    reply = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert _error(reply, 400)["param"] == param
    assert client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 1}).status_code == 200


def test_a_lone_surrogate_in_a_chat_message_is_a_400() -> None:
    raw = json.dumps({"messages": [{"role": "user", "content": "\ud800"}]}).encode()
    reply = _client().post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert _error(reply, 400)["param"] == "messages"


def test_a_prompt_past_the_character_bound_is_refused_before_tokenizing() -> None:
    tokenizer = SpyTokenizer()
    client = _client(FakeEngine(max_model_len=64), tokenizer)
    reply = client.post("/v1/completions", json={"prompt": "x" * 100_000})
    error = _error(reply, 400)
    assert error["code"] == "context_length_exceeded" and error["param"] == "prompt"
    assert tokenizer.encoded_chars == 0


def test_a_large_prompt_is_tokenized_off_the_event_loop() -> None:
    tokenizer = SpyTokenizer()
    client = _client(FakeEngine(max_model_len=1024), tokenizer)
    reply = client.post("/v1/completions", json={"prompt": "y" * 20_000})
    assert _error(reply, 400)["code"] == "context_length_exceeded"  # tokenized, then too long
    assert tokenizer.encoded_chars == 20_000
    small = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1})
    assert small.status_code == 200
    assert len(tokenizer.threads) == 2  # the loop's thread for "hi", a worker for the big one


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_puts_usage_on_every_chunk(path: str) -> None:
    body = {"max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chat = {"messages": [{"role": "user", "content": "ab"}]}
    body |= {"prompt": "ab"} if path == "/v1/completions" else chat
    text = _client().post(path, json=body).text
    chunks = [json.loads(b[6:]) for b in text.split("\n\n") if b and b != "data: [DONE]"]
    assert all("usage" in c for c in chunks)
    assert [c["usage"]["completion_tokens"] for c in chunks][-1] == 3
    plain = _client().post(path, json=body | {"stream_options": {"include_usage": True}}).text
    assert sum('"usage"' in b for b in plain.split("\n\n")) == 1


def test_json_depth_counts_brackets_outside_strings_only() -> None:
    assert not json_depth_exceeds(b'{"a": "' + b"[" * 70 + b'"}', 3)
    assert not json_depth_exceeds(b'{"a": "\\"[[[[[[[[[[[[[[[", "b": [1]}', 3)
    assert json_depth_exceeds(b'{"a": [[[1]]]}', 3)
    assert not json_depth_exceeds(b'{"a": [[1]], "b": [[2]]}', 3)
    assert json_depth_exceeds(b"[" * 3000, 64)


def test_requests_take_no_hop_through_the_worker_thread_pool(monkeypatch):
    """Routes and dependencies are async: FastAPI runs a plain ``def`` one in AnyIO's thread pool,
    a thread hop per request that left each daemon 40 idle pool threads after a burst."""
    client = _client()
    started: list[str] = []
    real_start = threading.Thread.start

    def spy(thread: threading.Thread) -> None:
        started.append(thread.name)
        real_start(thread)

    monkeypatch.setattr(threading.Thread, "start", spy)
    for path in ("/health", "/ready", "/metrics", "/v1/models"):
        assert client.get(path).status_code in (200, 503)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2}), ("/v1/chat/completions", chat)):
        assert client.post(path, json=body).status_code == 200
        assert client.post(path, json={**body, "stream": True}).status_code == 200
    assert "AnyIO worker thread" not in started, started
