"""``kv_transfer_params`` in the serving layer: its shape, each role's path, the decode node's checks.

The transfer itself runs between real daemons in tests/decode_node/test_kv_transfer_params.py; here
a scripted engine shows which id and peer a request runs under and what each refusal says.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from serving_fakes import CharTokenizer, FakeEngine

from common.cluster_auth import ClusterKey
from common.config import NodeConfig
from common.kv_layout import KVLayout
from common.metrics import NodeMetrics
from common.request_id import ANY_DECODE, make_request_id, parse_tags
from common.serving.app import build_app

LAYOUT = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32")
ASK = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None, "remote_block_ids": None,
       "remote_host": None, "remote_port": None}
BODY = {"prompt": "hello there", "max_tokens": 3}
P_ADDR, D_ADDR = "127.0.0.1:14579", "127.0.0.1:14580"


def _node(role: str, key: str | None = None, layout: KVLayout = LAYOUT, **engine: Any) -> tuple[TestClient, FakeEngine]:
    fake = FakeEngine(**engine)
    fake.kv_layout = layout  # type: ignore[attr-defined]  # what AsyncLLMEngine has
    kv_port = {"prefill": 14579, "decode": 14580}.get(role)
    config = NodeConfig(role=role, kv_port=kv_port, cluster_key_file=key)
    return TestClient(build_app(fake, CharTokenizer(), config, NodeMetrics(role)), raise_server_exceptions=False), fake


def _prefill(client: TestClient, body: dict = BODY) -> dict:
    r = client.post("/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": ASK},
                    headers={"X-Request-Id": "router-1"})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _decode(client: TestClient, params: dict, body: dict = BODY):
    return client.post("/v1/completions", json={**body, "kv_transfer_params": {**params, "do_remote_prefill": True}})


@pytest.mark.parametrize(("value", "named"), [
    ({"remote_port": "14579"}, "kv_transfer_params.remote_port"),
    ({"remote_port": 70000}, "kv_transfer_params.remote_port"),
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
    ({"remote_host": "h" * 300}, "kv_transfer_params.remote_host"),
    ({"remote_block_ids": ["a"]}, "kv_transfer_params.remote_block_ids"),
    ({f"x{i}": i for i in range(17)}, "other fields"),
    ([1, 2], "an object or null"),
])
@pytest.mark.parametrize("role", ["both", "prefill", "decode"])
def test_a_malformed_field_is_a_400_naming_it(role: str, value: Any, named: str) -> None:
    client, fake = _node(role)
    r = client.post("/v1/completions", json={**BODY, "kv_transfer_params": value},
                    headers={"X-Request-Id": make_request_id(P_ADDR, D_ADDR)})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == "kv_transfer_params" and named in error["message"]
    assert not fake.calls


def test_a_colocated_node_takes_neutral_params_and_refuses_a_transfer() -> None:
    client, _ = _node("both")
    assert client.post("/v1/completions", json={**BODY, "kv_transfer_params": None}).status_code == 200
    r = client.post("/v1/completions", json={**BODY, "kv_transfer_params": ASK})
    assert r.status_code == 400 and r.json()["error"]["code"] == "kv_transfer_params_unsupported"


def test_prefill_mints_a_transfer_id_naming_itself_and_answers_with_the_params() -> None:
    client, fake = _node("prefill")
    params = _prefill(client)
    call = fake.calls[0]
    tags = parse_tags(call.request_id)
    assert tags is not None and tags.prefill_addr == P_ADDR and tags.decode_addr == ANY_DECODE
    assert call.params.max_tokens == 1 and call.kv_transfer_params == {"prefill_addr": P_ADDR, "decode_addr": ANY_DECODE}
    assert params["transfer_id"] == call.request_id and params["do_remote_prefill"] is True
    assert (params["remote_host"], params["remote_port"]) == ("127.0.0.1", 14579)
    assert params["num_blocks"] == 3 and params["kv_layout"] == LAYOUT.fingerprint()  # 12 tokens, blocks of 4
    assert params["first_token"] == ord("a") and params["signature"] is None  # keyless: unsigned


def test_prefill_refuses_a_stream_and_a_tagged_id_keeps_the_tag_path() -> None:
    client, fake = _node("prefill")
    r = client.post("/v1/completions", json={**BODY, "stream": True, "kv_transfer_params": ASK})
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream"
    tagged = make_request_id(P_ADDR, D_ADDR)
    r = client.post("/v1/completions", json={**BODY, "kv_transfer_params": ASK}, headers={"X-Request-Id": tagged})
    assert r.status_code == 200 and "kv_transfer_params" not in r.json()
    assert fake.calls[-1].request_id == tagged


def test_decode_runs_under_the_transfer_id_from_the_prefill_node_named() -> None:
    prefill, _ = _node("prefill")
    params = _prefill(prefill)
    client, fake = _node("decode")
    r = _decode(client, params)
    assert r.status_code == 200, r.text
    call = fake.calls[0]
    assert call.request_id == params["transfer_id"] and call.params.max_tokens == 3
    assert call.kv_transfer_params == {"prefill_addr": P_ADDR, "decode_addr": D_ADDR}
    again = _decode(client, params)  # spent here
    assert again.status_code == 409 and again.json()["error"]["code"] == "kv_already_pulled"


@pytest.mark.parametrize(("change", "status", "code"), [
    ({"kv_layout": "0" * 16}, 400, "kv_transfer_params_invalid"),
    ({"kv_ranks": 2}, 400, "kv_transfer_params_unsupported"),
    ({"expires_at": 1}, 410, "kv_expired"),
    ({"transfer_id": make_request_id(P_ADDR, D_ADDR)}, 400, "kv_transfer_params_invalid"),
    ({"transfer_id": None}, 400, "kv_transfer_params_invalid"),
    ({"do_remote_prefill": False, "do_remote_decode": True}, 400, "kv_transfer_params_unsupported"),
])
def test_decode_checks_the_params_keyless(change: dict, status: int, code: str) -> None:
    prefill, _ = _node("prefill")
    params = _prefill(prefill)
    client, fake = _node("decode")
    r = client.post("/v1/completions", json={**BODY, "kv_transfer_params": {**params, "do_remote_prefill": True,
                                                                            **change}})
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
    assert not fake.calls
    assert _decode(client, params).status_code == 200  # a refusal spends nothing


def test_decode_refuses_another_prompt() -> None:
    prefill, _ = _node("prefill")
    params = _prefill(prefill)
    client, _ = _node("decode")
    r = _decode(client, params, {**BODY, "prompt": "hello thera"})
    assert r.status_code == 400 and "prompt" in r.json()["error"]["message"]


def test_with_a_key_params_are_signed_and_checked(tmp_path) -> None:
    key = str(ClusterKey.generate(tmp_path / "k"))
    prefill, _ = _node("prefill", key)
    params = _prefill(prefill)
    assert params["signature"].startswith("v1.")
    client, _ = _node("decode", key)
    for change in ({"first_token": 7}, {"num_blocks": 4}, {"signature": None}):
        r = _decode(client, {**params, **change})
        assert r.status_code == 403 and r.json()["error"]["code"] == "kv_transfer_params_forged", r.text
    other = str(ClusterKey.generate(tmp_path / "other"))
    r = _decode(_node("decode", other)[0], params)
    assert r.status_code == 403
    assert _decode(client, params).status_code == 200


@pytest.mark.parametrize(("error", "status", "code"), [
    ("producer: KV already pulled (a kv_transfer_params transfer id is pulled once)", 409, "kv_already_pulled"),
    ("producer: request already pulled", 409, "kv_already_pulled"),
    ("producer: producer lease expired", 410, "kv_expired"),
    ("producer 127.0.0.1:1 unreachable: no response from peer before the deadline", 502, "engine_error"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_pull_the_prefill_node_refuses_is_the_clients_4xx(error: str, status: int, code: str, stream: bool) -> None:
    prefill, _ = _node("prefill")
    params = _prefill(prefill)
    client, _ = _node("decode", error=error, error_after=0)
    r = _decode(client, params, {**BODY, "stream": stream})  # a stream's reply starts with its first token
    assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text


def test_a_stream_on_the_params_path_streams_once_its_first_token_came() -> None:
    prefill, _ = _node("prefill")
    params = _prefill(prefill)
    client, fake = _node("decode", delay_s=0.01)
    r = _decode(client, params, {**BODY, "stream": True})
    texts = [json.loads(line[6:])["choices"][0]["text"] for line in r.text.splitlines()
             if line.startswith("data: {")]
    assert r.status_code == 200 and texts == ["a", "b", "c", ""] and r.text.endswith("data: [DONE]\n\n")
    assert not fake.running and not fake.aborted
