"""Who a request is from, for fair share (common/serving/client_id.py): the API key, else the
cache salt, else the user field, else the shared pool; a key is never kept in the clear."""

from __future__ import annotations

from starlette.requests import Request

from common.serving.client_id import client_id
from common.serving.protocol import CompletionRequest


def request(authorization: str | None = None) -> Request:
    headers = [] if authorization is None else [(b"authorization", authorization.encode())]
    return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers})


def test_the_api_key_comes_first_and_only_its_hash_is_kept():
    body = CompletionRequest(prompt="x", user="alice", cache_salt="s1")
    a, b = client_id(request("Bearer key-A"), body), client_id(request("bearer key-B"), body)
    assert a.startswith("key:") and a != b and "key-A" not in a
    assert client_id(request("Bearer key-A"), CompletionRequest(prompt="y")) == a


def test_then_the_cache_salt_then_the_user_then_one_pool():
    assert client_id(request(), CompletionRequest(prompt="x", user="alice", cache_salt="s1")) == "salt:s1"
    assert client_id(request("Basic abc"), CompletionRequest(prompt="x", user="alice")) == "user:alice"
    assert client_id(request(), CompletionRequest(prompt="x")) == ""
