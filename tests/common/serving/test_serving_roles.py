"""Request ids, node roles and tags, the prepare hook, and the operational routes."""

from __future__ import annotations

import re

import pytest
from fastapi import Request
from fastapi.testclient import TestClient
from serving_fakes import CharTokenizer, FakeEngine

from common.config import NodeConfig
from common.metrics import NodeMetrics
from common.request_id import LOCAL_PREFILL, make_request_id
from common.serving.app import build_app
from common.serving.context import PreparedRequest
from common.serving.errors import OpenAIError

TAGGED = make_request_id("10.0.0.1:14579", "10.0.0.2:14580", "abc123")


def _client(engine: FakeEngine, role: str = "both", **kwargs) -> TestClient:
    app = build_app(engine, CharTokenizer(), NodeConfig(role=role), NodeMetrics(role), **kwargs)
    return TestClient(app)


@pytest.mark.parametrize("stream", [False, True])
def test_tagged_id_reaches_the_engine_but_never_the_reply_body(stream: bool) -> None:
    engine = FakeEngine()
    reply = _client(engine).post(
        "/v1/completions", json={"prompt": "x", "max_tokens": 1, "stream": stream}, headers={"X-Request-Id": TAGGED}
    )
    assert reply.headers["X-Request-Id"] == TAGGED  # only the proxy reads a node's headers
    assert engine.calls[0].request_id == TAGGED
    assert "prefill_addr" not in reply.text
    if not stream:
        assert reply.json()["id"] == "cmpl-abc123"
    else:
        assert '"id":"cmpl-abc123"' in reply.text


@pytest.mark.parametrize("stream", [False, True])
def test_error_messages_never_show_the_routing_tag(stream: bool) -> None:
    engine = FakeEngine(error=f"KV for {TAGGED} never came", error_after=0)
    body = {"prompt": "x", "max_tokens": 2, "stream": stream}
    failed = _client(engine).post("/v1/completions", json=body, headers={"X-Request-Id": TAGGED})
    assert "never came" in failed.text and "abc123" in failed.text and "prefill_addr" not in failed.text
    busy = FakeEngine()
    busy.running.add(TAGGED)  # the engine refuses a duplicate id, naming it
    refused = _client(busy).post("/v1/completions", json=body, headers={"X-Request-Id": TAGGED})
    assert "already running" in refused.text and "prefill_addr" not in refused.text


@pytest.mark.parametrize(("path", "prefix"),
                         [("/v1/completions", "cmpl-"), ("/v1/chat/completions", "chatcmpl-")])
@pytest.mark.parametrize("stream", [False, True])
def test_client_request_id_is_echoed_and_body_id_has_the_openai_prefix(path: str, prefix: str,
                                                                        stream: bool) -> None:
    engine = FakeEngine()
    body = {"max_tokens": 1, "stream": stream}
    body |= {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    reply = _client(engine).post(path, json=body, headers={"X-Request-Id": "my-id-42"})
    assert reply.headers["X-Request-Id"] == "my-id-42"
    assert engine.calls[0].request_id == "my-id-42"
    assert f'"id":"{prefix}my-id-42"' in reply.text.replace(" ", "")
    fresh = _client(FakeEngine()).post(path, json=body)
    assert re.search(f'"id":"{prefix}[0-9a-f]{{32}}"', fresh.text.replace(" ", ""))
    assert fresh.headers["X-Request-Id"].startswith(prefix)


def test_request_id_is_generated_when_absent() -> None:
    engine = FakeEngine()
    reply = _client(engine).post("/v1/completions", json={"prompt": "x", "max_tokens": 1})
    assert re.fullmatch(r"cmpl-[0-9a-f]{32}", reply.json()["id"])
    assert reply.headers["X-Request-Id"] == reply.json()["id"] == engine.calls[0].request_id


def test_tags_on_a_both_node_still_reach_the_engine() -> None:
    engine = FakeEngine()
    _client(engine).post("/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers={"X-Request-Id": TAGGED})
    assert engine.calls[0].kv_transfer_params == {"prefill_addr": "10.0.0.1:14579", "decode_addr": "10.0.0.2:14580"}


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_untagged_request_to_a_daemon_is_400(role: str) -> None:
    engine = FakeEngine()
    client = _client(engine, role)
    reply = client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "plain-id"})
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert f"role '{role}'" in message and "___prefill_addr_" in message and "___decode_addr_" in message
    assert reply.headers["X-Request-Id"] == "plain-id"
    assert engine.calls == []
    tagged = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                       "max_tokens": 1}, headers={"X-Request-Id": TAGGED})
    assert tagged.status_code == 200
    assert engine.calls[0].kv_transfer_params == {"prefill_addr": "10.0.0.1:14579", "decode_addr": "10.0.0.2:14580"}
    assert engine.calls[0].request_id == TAGGED



def test_a_local_prefill_tag_is_refused_by_a_prefill_node_and_asks_no_peer_on_a_decode_node() -> None:
    """``local:0`` names no KV endpoint: the decode node prefills the prompt itself, a prefill node
    has nothing to do for it (400, nothing reaches its engine)."""
    local = make_request_id(LOCAL_PREFILL, "10.0.0.2:14580", "abc123")
    body = {"prompt": "x", "max_tokens": 1}
    engine = FakeEngine()
    refused = _client(engine, "prefill").post("/v1/completions", json=body, headers={"X-Request-Id": local})
    assert refused.status_code == 400 and refused.json()["error"]["code"] == "local_prefill"
    assert engine.calls == []
    served = _client(engine, "decode").post("/v1/completions", json=body, headers={"X-Request-Id": local})
    assert served.status_code == 200
    assert engine.calls[0].kv_transfer_params == {"prefill_addr": "", "decode_addr": "10.0.0.2:14580"}

def test_daemon_refuses_a_batch_of_prompts() -> None:
    reply = _client(FakeEngine(), "decode").post(
        "/v1/completions", json={"prompt": ["a", "b"]}, headers={"X-Request-Id": TAGGED}
    )
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"


def test_prepare_hook_can_adjust_or_refuse() -> None:
    async def prefill_only(prepared: PreparedRequest, request: Request) -> None:
        if request.headers.get("X-Refuse"):
            raise OpenAIError("refused by the role", param="X-Refuse")
        prepared.params.max_tokens = 1
        assert prepared.kv_transfer_params is not None
        prepared.kv_transfer_params["do_remote_decode"] = True

    engine = FakeEngine()
    client = _client(engine, "prefill", prepare_request=prefill_only)
    ok = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 9}, headers={"X-Request-Id": TAGGED})
    assert ok.json()["usage"]["completion_tokens"] == 1
    assert engine.calls[0].kv_transfer_params["do_remote_decode"] is True
    refused = client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": TAGGED, "X-Refuse": "1"})
    assert refused.status_code == 400 and refused.json()["error"]["message"] == "refused by the role"


def test_health_ready_models() -> None:
    state = {"ready": False}
    client = _client(FakeEngine(), ready=lambda: state["ready"])
    assert client.get("/health").status_code == 200
    assert client.get("/ready").status_code == 503
    state["ready"] = True
    assert client.get("/ready").status_code == 200
    models = client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["fake-model"]
    missing = client.get("/v1/nothing")
    assert missing.status_code == 404 and "error" in missing.json()


def test_metrics_count_tokens_successes_and_errors() -> None:
    client = _client(FakeEngine())
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 0})
    text = client.get("/metrics").text
    assert 'pdserve:prompt_tokens_total{role="both"} 3.0' in text
    assert 'pdserve:generation_tokens_total{role="both"} 3.0' in text
    assert 'pdserve:request_success_total{finish_reason="length",role="both"} 1.0' in text
    assert 'pdserve:request_errors_total{kind="invalid_request",role="both"} 1.0' in text
    assert 'pdserve:time_to_first_token_seconds_count{role="both"} 1.0' in text
    assert 'pdserve:inter_token_latency_seconds_count{role="both"} 2.0' in text
    assert 'pdserve:e2e_request_latency_seconds_count{role="both"} 1.0' in text
    assert 'pdserve:kv_cache_usage_perc{role="both"} 0.0' in text
    assert "pdserve:kv_transfer_bytes_total" in text and "pdserve:kv_leases_expired_total" in text
