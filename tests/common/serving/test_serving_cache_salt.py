"""``cache_salt`` in a request body: it reaches the engine, and a bad one is a 400 naming it."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from serving_fakes import CharTokenizer, FakeEngine

from common.config import NodeConfig
from common.metrics import NodeMetrics
from common.serving.app import build_app


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> TestClient:
    return TestClient(build_app(engine, CharTokenizer(), NodeConfig(), NodeMetrics("both")),
                      raise_server_exceptions=False)


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("path, body", [("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", CHAT)])
def test_the_salt_reaches_the_engine(client: TestClient, engine: FakeEngine, path: str, body: dict) -> None:
    assert client.post(path, json={**body, "max_tokens": 2, "cache_salt": "tenant-7"}).status_code == 200
    assert client.post(path, json={**body, "max_tokens": 2}).status_code == 200
    assert [c.params.cache_salt for c in engine.calls] == ["tenant-7", None]


@pytest.mark.parametrize("salt", ["", "x" * 257, 7, ["a"], "\ud800"])
def test_a_bad_salt_is_a_400_naming_it(client: TestClient, engine: FakeEngine, salt: Any) -> None:
    raw = json.dumps({"prompt": "hi", "cache_salt": salt})  # ASCII-escaped: a lone surrogate survives
    reply = client.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == "cache_salt" and not engine.calls
    assert client.post("/v1/completions", json={"prompt": "hi", "cache_salt": "x" * 256}).status_code == 200
