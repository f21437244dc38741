"""``pdserve_peer_prefix``, the proxy's peer-tier hint: it reaches the engine only for a peer the node
vouches for (the registry named it), is ignored and counted otherwise, and a malformed one is a 400."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from serving_fakes import CharTokenizer, FakeEngine

from common.config import NodeConfig
from common.metrics import NodeMetrics
from common.serving.app import build_app

PEER = "10.0.0.7:5557"


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def app(engine: FakeEngine):
    return build_app(engine, CharTokenizer(), NodeConfig(), NodeMetrics("both"))


def test_a_vouched_hint_reaches_the_engine_and_another_is_ignored(app, engine: FakeEngine) -> None:
    client = TestClient(app)
    app.state.serving.peer_vouched = lambda kv_addr: kv_addr == PEER
    hint = {"kv_addr": PEER, "blocks": 3}
    assert client.post("/v1/completions", json={"prompt": "hi", "pdserve_peer_prefix": hint}).status_code == 200
    stranger = {"kv_addr": "203.0.113.9:5557", "blocks": 3}
    assert client.post("/v1/completions", json={"prompt": "hi", "pdserve_peer_prefix": stranger}).status_code == 200
    assert client.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert [c.params.kv_peer for c in engine.calls] == [(PEER, 3), None, None]
    assert app.state.serving.peer_hints_ignored == 1


@pytest.mark.parametrize("hint", [{"kv_addr": PEER}, {"kv_addr": PEER, "blocks": 0}, {"kv_addr": PEER, "blocks": 1 << 21},
                                  {"kv_addr": "no port", "blocks": 1}, {"kv_addr": 5, "blocks": 1}, "10.0.0.7:5557",
                                  {"kv_addr": PEER, "blocks": 1, "extra": 1}])
def test_a_malformed_hint_is_a_400(app, engine: FakeEngine, hint: Any) -> None:
    reply = TestClient(app, raise_server_exceptions=False).post(
        "/v1/completions", json={"prompt": "hi", "pdserve_peer_prefix": hint})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"].startswith("pdserve_peer_prefix") and not engine.calls
