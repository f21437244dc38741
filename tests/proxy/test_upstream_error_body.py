"""A node's error body reaches the client as the node wrote it, with OpenAI's ``type`` and ``code``
words filled in when the node left them null or out (a vLLM node answers ``"code": null``)."""

from __future__ import annotations

import json

import pytest

from proxy.errors import UpstreamError


def _relayed(body: object, status: int = 400) -> dict:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return json.loads(UpstreamError("decode", "10.0.0.2:8200", status, raw).body_bytes())


def test_a_complete_body_is_relayed_byte_for_byte() -> None:
    body = b'{"error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": "invalid_value"}}'
    assert UpstreamError("decode", "d:1", 400, body).body_bytes() == body


@pytest.mark.parametrize("error, filled", [
    ({"message": "m", "type": "BadRequestError", "param": None, "code": None}, {"code": "upstream_error"}),
    ({"message": "m", "type": "BadRequestError", "param": None}, {"code": "upstream_error"}),
    ({"message": "m", "code": 400}, {"type": "invalid_request_error", "code": "upstream_error", "param": None}),
    ({"message": "m", "type": "", "code": ""}, {"type": "invalid_request_error", "code": "upstream_error"}),
])
def test_a_null_or_missing_word_is_filled_in_and_the_rest_is_kept(error: dict, filled: dict) -> None:
    relayed = _relayed({"error": error, "object": "error"})
    assert relayed["object"] == "error" and relayed["error"]["message"] == "m"
    for key, word in filled.items():
        assert relayed["error"][key] == word
    assert relayed["error"]["type"] and relayed["error"]["code"]


def test_a_server_error_gets_the_server_error_type() -> None:
    assert _relayed({"error": {"message": "boom", "code": None}}, status=500)["error"]["type"] == "server_error"


@pytest.mark.parametrize("body", [b"not json", b"[1, 2]", b'{"error": "text"}', b'{"detail": "x"}'])
def test_a_body_that_is_not_an_openai_error_becomes_the_proxy_s_own(body: bytes) -> None:
    relayed = _relayed(body, status=502)
    assert relayed["error"]["code"] == "upstream_error" and "answered 502" in relayed["error"]["message"]
