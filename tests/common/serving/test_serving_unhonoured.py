"""Fields the server knows but does not implement: a 400 naming them unless they ask for nothing."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from serving_fakes import CharTokenizer, FakeEngine

from common.config import NodeConfig
from common.metrics import NodeMetrics
from common.serving.app import build_app
from common.serving.unhonoured import IGNORED, REFUSED

CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
COMPLETION = ("/v1/completions", {"prompt": "hi", "max_tokens": 2})


@pytest.fixture
def client() -> TestClient:
    app = build_app(FakeEngine(), CharTokenizer(), NodeConfig(), NodeMetrics("both"))
    return TestClient(app, raise_server_exceptions=False)


def _post(client: TestClient, route: tuple[str, dict], **fields: Any):
    path, body = route
    return client.post(path, json={"model": "fake-model", **body, **fields})


@pytest.mark.parametrize("route", [CHAT, COMPLETION], ids=["chat", "completions"])
@pytest.mark.parametrize(("name", "value"), [
    ("functions", [{"name": "f"}]), ("function_call", {"name": "f"}),
    ("service_tier", "flex"), ("store", True), ("length_penalty", 1.2),
    ("guided_json", {"type": "object"}), ("use_beam_search", True), ("reasoning_effort", "low"),
])
def test_a_field_that_asks_for_something_is_refused(client: TestClient, route, name: str, value: Any) -> None:
    reply = _post(client, route, **{name: value})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == name and error["code"] == "unsupported_parameter"


@pytest.mark.parametrize("route", [CHAT, COMPLETION], ids=["chat", "completions"])
def test_neutral_values_and_ignored_fields_are_accepted(client: TestClient, route) -> None:
    """What benchmark clients and vLLM's proxy send: no-ops, so the request is served."""
    fields = {"presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "none",
              "repetition_penalty": 1.0, "service_tier": "auto", "store": False, "user": "u-1",
              "metadata": {"k": "v"}, "parallel_tool_calls": True, "kv_transfer_params": {"do_remote_decode": False},
              "some_future_field": 1}
    assert _post(client, route, **fields).status_code == 200


def test_chat_echo_and_completions_top_logprobs(client: TestClient) -> None:
    assert _post(client, CHAT, echo=True).json()["error"]["param"] == "echo"
    assert _post(client, CHAT, echo=False).status_code == 200
    assert _post(client, COMPLETION, top_logprobs=3).json()["error"]["param"] == "top_logprobs"


@pytest.mark.parametrize(("name", "value"), [("tools", [{"type": "function", "function": {"name": "f"}}]),
                                             ("tool_choice", "required")])
def test_completions_refuse_the_chat_tool_fields(client: TestClient, name: str, value: Any) -> None:
    assert _post(client, COMPLETION, **{name: value}).json()["error"]["param"] == name
    assert _post(client, COMPLETION, tools=[], tool_choice="none").status_code == 200


def test_true_is_not_a_neutral_number(client: TestClient) -> None:
    assert _post(client, CHAT, priority=False).status_code == 400  # False is not 0 here
    assert _post(client, CHAT, priority=0).status_code == 200


def test_the_tables_do_not_overlap() -> None:
    assert not set(REFUSED) & set(IGNORED)


def test_response_format_without_a_tokenizer_is_a_400_naming_it() -> None:
    tokenizerless = build_app(FakeEngine(), None, NodeConfig(), NodeMetrics("both"))
    reply = TestClient(tokenizerless).post("/v1/completions", json={
        "prompt": [1, 2], "max_tokens": 2, "response_format": {"type": "json_object"}})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "response_format"
    assert TestClient(tokenizerless).post("/v1/completions", json={
        "prompt": [1, 2], "max_tokens": 2, "response_format": {"type": "text"}}).status_code == 200
