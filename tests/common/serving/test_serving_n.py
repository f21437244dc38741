"""``n`` choices over a scripted engine: one engine request per prompt carrying n, choices
numbered prompt * n + i, streamed interleaved by index, usage counting every choice and each
prompt once; past ``--max-n`` a 400 naming ``n`` with a code."""

from __future__ import annotations

import json

from fastapi.testclient import TestClient
from serving_fakes import CharTokenizer, FakeEngine

from common.config import NodeConfig
from common.metrics import NodeMetrics
from common.serving.app import build_app


def client_for(engine: FakeEngine, **config) -> TestClient:
    return TestClient(build_app(engine, CharTokenizer(), NodeConfig(**config), NodeMetrics("both")),
                      raise_server_exceptions=False)


def events(reply) -> list[dict]:
    lines = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completion_choices_and_usage():
    engine = FakeEngine()
    data = client_for(engine).post("/v1/completions", json={"prompt": ["ab", "c"], "n": 3, "max_tokens": 2,
                                                            "best_of": 3}).json()
    assert [c["index"] for c in data["choices"]] == list(range(6))
    assert all(c["text"] == "ab" and c["finish_reason"] == "length" for c in data["choices"])
    assert [call.params.n for call in engine.calls] == [3, 3]  # one engine request per prompt
    assert data["usage"]["prompt_tokens"] == 3 + 2  # each prompt once
    assert data["usage"]["completion_tokens"] == 6 * 2


def test_chat_stream_interleaves_choices_by_index():
    engine = FakeEngine()
    reply = client_for(engine).post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "n": 2, "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    chunks = events(reply)
    roles = [c["choices"][0]["index"] for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    assert roles == [0, 1]
    text = {0: "", 1: ""}
    finish = {}
    for c in chunks:
        for choice in c["choices"]:
            text[choice["index"]] += choice["delta"].get("content", "")
            if choice["finish_reason"]:
                finish[choice["index"]] = choice["finish_reason"]
    assert text == {0: "abc", 1: "abc"} and finish == {0: "length", 1: "length"}
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_chat_non_stream_has_n_messages():
    data = client_for(FakeEngine()).post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "n": 4, "max_tokens": 2}).json()
    assert [(c["index"], c["message"]["content"]) for c in data["choices"]] == [(i, "ab") for i in range(4)]


def test_max_n_bounds_n():
    client = client_for(FakeEngine(), max_n=2)
    assert client.post("/v1/completions", json={"prompt": "x", "n": 2, "max_tokens": 1}).status_code == 200
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "n": 3})
    assert reply.status_code == 400
    error = reply.json()["error"]
    assert error["param"] == "n" and error["code"] == "invalid_value" and "--max-n" in error["message"]
