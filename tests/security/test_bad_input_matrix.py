"""Bad input, through the proxy (real prefill + decode behind it) and straight to a node.

Every case must be a 4xx with the OpenAI error body ``{"error": {"message", "type",
"param", "code"}}`` (``code`` a word, never the status); none may be a 5xx; and the
cluster must serve normally afterwards, with its nodes idle.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field

import httpx
import pytest

from helpers.cluster import Proc, start, static_nodes, wait_idle

BIG = 2**70
OK_PROMPT = {"model": "pdserve-tiny", "prompt": "hello", "max_tokens": 2}
OK_CHAT = {"model": "pdserve-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@dataclass
class Case:
    name: str
    content: bytes | None = None  # raw body; None = no body
    path: str = "/v1/completions"
    method: str = "POST"
    status: int = 400
    param: str | None = field(default=None)  # checked when set
    code: str | None = None  # checked when set
    headers: dict[str, str] = field(default_factory=dict)


def _completion(name: str, param: str | None, status: int = 400, code: str | None = None, **fields) -> Case:
    return Case(name, json.dumps({**OK_PROMPT, **fields}).encode(), param=param, status=status, code=code)


def _chat(name: str, param: str | None, status: int = 400, code: str | None = None, **fields) -> Case:
    return Case(name, json.dumps({**OK_CHAT, **fields}).encode(), "/v1/chat/completions", param=param,
                status=status, code=code)


def _raw(name: str, content: bytes, param: str | None = "body", path: str = "/v1/completions",
         status: int = 400, code: str | None = None) -> Case:
    return Case(name, content, path, param=param, status=status, code=code)


CASES = [
    # issue 11, item 6
    _completion("seed-2^70", "seed", seed=BIG),
    _raw("lone-surrogate-prompt", b'{"model": "pdserve-tiny", "prompt": "\\ud800", "max_tokens": 2}',
         "prompt"),
    _raw("3000-nested-brackets", b"[" * 3000, code="nesting_too_deep"),
    # issue 12, item 5
    _completion("wrong-model", "model", 404, "model_not_found", model="gpt-4"),
    _chat("wrong-model-chat", "model", 404, "model_not_found", model="gpt-4"),
    _raw("empty-body", b"", code="missing_body"),
    _raw("empty-body-chat", b"", path="/v1/chat/completions", code="missing_body"),
    Case("unknown-path", b"{}", "/v1/nope", status=404, code="unknown_url"),
    Case("unknown-path-get", None, "/nope", "GET", status=404, code="unknown_url"),
    Case("embeddings-not-served", b"{}", "/v1/embeddings", status=404, code="unknown_url"),
    Case("get-completions", None, "/v1/completions", "GET", status=405, code="method_not_allowed"),
    Case("put-chat", b"{}", "/v1/chat/completions", "PUT", status=405, code="method_not_allowed"),
    Case("delete-models", None, "/v1/models", "DELETE", status=405, code="method_not_allowed"),
    Case("post-models", b"{}", "/v1/models", status=405, code="method_not_allowed"),
    Case("post-health", b"{}", "/health", status=405, code="method_not_allowed"),
    # integers out of range
    _completion("seed-minus-2^70", "seed", seed=-BIG),
    _completion("seed-string", "seed", seed="1"),
    _completion("max-tokens-2^70", "max_tokens", max_tokens=BIG),
    _completion("max-tokens-zero", "max_tokens", max_tokens=0),
    _completion("max-tokens-negative", "max_tokens", max_tokens=-1),
    _completion("max-tokens-string", "max_tokens", max_tokens="5"),
    _completion("max-tokens-float", "max_tokens", max_tokens=1.5),
    _completion("max-tokens-past-context", "max_tokens", code="context_length_exceeded", max_tokens=5000),
    _completion("top-k-2^70", "top_k", top_k=BIG),
    _completion("top-k-minus-5", "top_k", top_k=-5),
    _completion("top-k-float", "top_k", top_k=2.5),
    _completion("logprobs-2^70", "logprobs", logprobs=BIG),
    _completion("logprobs-21", "logprobs", logprobs=21),
    _completion("logprobs-negative", "logprobs", logprobs=-1),
    _completion("logprobs-int32-overflow", "logprobs", logprobs=2**31),
    _completion("logprobs-string", "logprobs", logprobs="5"),
    _completion("n-2^70", "n", n=BIG),
    _completion("n-past-max-n", "n", n=17),  # the default --max-n is 16
    _completion("n-zero", "n", n=0),
    _completion("stop-token-id-2^70", "stop_token_ids", stop_token_ids=[BIG]),
    _completion("stop-token-id-negative", "stop_token_ids", stop_token_ids=[-1]),
    _completion("stop-token-ids-string", "stop_token_ids", stop_token_ids="x"),
    _completion("token-id-2^70", "prompt", prompt=[BIG]),
    _completion("token-id-negative", "prompt", prompt=[-1]),
    _completion("token-id-outside-vocab", "prompt", prompt=[5, 999_999]),
    _completion("token-ids-nested-2^70", "prompt", prompt=[[1, BIG]]),
    # floats
    _completion("temperature-negative", "temperature", temperature=-1),
    _completion("temperature-huge", "temperature", temperature=1e300),
    _completion("temperature-string", "temperature", temperature="hot"),
    _raw("temperature-nan", b'{"model": "pdserve-tiny", "prompt": "x", "temperature": NaN}', "temperature"),
    _raw("top-p-infinity", b'{"model": "pdserve-tiny", "prompt": "x", "top_p": Infinity}', "top_p"),
    _completion("top-p-zero", "top_p", top_p=0),
    _completion("top-p-two", "top_p", top_p=2),
    # prompts
    _completion("prompt-empty", "prompt", prompt=""),
    _completion("prompt-empty-list", "prompt", prompt=[]),
    _completion("prompt-empty-token-list", "prompt", prompt=[[]]),
    _completion("prompt-bools", "prompt", prompt=[True]),
    _completion("prompt-floats", "prompt", prompt=[1.5]),
    _completion("prompt-object", "prompt", prompt={"a": 1}),
    _completion("prompt-number", "prompt", prompt=123),
    _completion("prompt-null", "prompt", prompt=None),
    _raw("prompt-missing", b'{"model": "pdserve-tiny", "max_tokens": 2}', "prompt"),
    _raw("lone-low-surrogate-in-list", b'{"model": "pdserve-tiny", "prompt": ["ok", "\\udc00"]}', "prompt"),
    _completion("prompt-too-long", "prompt", code="context_length_exceeded", prompt="hello " * 5000),
    _completion("token-prompt-too-long", "prompt", code="context_length_exceeded", prompt=[5] * 5000),
    _completion("prompt-past-character-bound", "prompt", code="context_length_exceeded",
                prompt="x" * 1_000_000),
    # other fields
    _completion("echo", "echo", echo=True),
    _completion("stop-number", "stop", stop=5),
    _completion("stop-list-of-numbers", "stop", stop=[5]),
    _completion("stop-nested", "stop", stop=[["a"]]),
    _raw("stop-lone-surrogate", b'{"model": "pdserve-tiny", "prompt": "x", "stop": "\\ud800"}', "stop"),
    _completion("model-number", "model", model=123),
    _raw("model-lone-surrogate", b'{"model": "\\ud800", "prompt": "x"}', "model"),
    _completion("stream-string", "stream", stream="yes"),
    _completion("stream-options-string", "stream_options", stream=True, stream_options="x"),
    _completion("stream-options-usage-string", "stream_options", stream=True,
                stream_options={"include_usage": "y"}),
    _completion("user-number", "user", user=5),
    _completion("ignore-eos-string", "ignore_eos", ignore_eos="no"),
    # chat
    _raw("chat-messages-missing", b'{"model": "pdserve-tiny"}', "messages", "/v1/chat/completions"),
    _chat("chat-messages-empty", "messages", messages=[]),
    _chat("chat-messages-string", "messages", messages="hi"),
    _chat("chat-messages-numbers", "messages", messages=[1]),
    _chat("chat-role-unknown", "messages", messages=[{"role": "alien", "content": "x"}]),
    _chat("chat-role-missing", "messages", messages=[{"content": "x"}]),
    _chat("chat-content-number", "messages", messages=[{"role": "user", "content": 5}]),
    _raw("chat-content-lone-surrogate",
         b'{"model": "pdserve-tiny", "messages": [{"role": "user", "content": "\\ud800"}]}', "messages",
         "/v1/chat/completions"),
    _raw("chat-text-part-lone-surrogate",
         b'{"model": "pdserve-tiny", "messages": [{"role": "user", "content": '
         b'[{"type": "text", "text": "\\udfff"}]}]}',
         "messages", "/v1/chat/completions"),
    _chat("chat-image-part", "messages", messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
    _chat("chat-max-completion-tokens-2^70", "max_completion_tokens", max_completion_tokens=BIG),
    _chat("chat-max-completion-tokens-negative", "max_completion_tokens", max_completion_tokens=-1),
    _chat("chat-top-logprobs-2^70", "top_logprobs", logprobs=True, top_logprobs=BIG),
    _chat("chat-top-logprobs-21", "top_logprobs", logprobs=True, top_logprobs=21),
    _chat("chat-top-logprobs-without-logprobs", "top_logprobs", top_logprobs=2),
    _chat("chat-logprobs-string", "logprobs", logprobs="yes"),
    _chat("chat-seed-2^70", "seed", seed=BIG),
    _chat("chat-too-long", "messages", code="context_length_exceeded",
          messages=[{"role": "user", "content": "x" * 1_000_000}]),
    # raw bodies
    _raw("whitespace-body", b"   \n"),
    _raw("not-json", b"{not json", code="invalid_json"),
    _raw("truncated-json", b'{"prompt": "x"', code="invalid_json"),
    _raw("json-array", b"[1, 2]"),
    _raw("json-null", b"null"),
    _raw("json-string", b'"prompt"'),
    _raw("json-number", b"42"),
    _raw("invalid-utf8", b'{"model": "pdserve-tiny", "prompt": "\xff\xfe"}'),
    _raw("3000-nested-objects", b'{"a":' * 3000, code="nesting_too_deep"),
    _raw("deep-prompt-list", b'{"prompt": ' + b"[" * 3000 + b"1" + b"]" * 3000 + b"}",
         code="nesting_too_deep"),
    _raw("deep-chat", b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}", path="/v1/chat/completions",
         code="nesting_too_deep"),
    _raw("duplicate-keys-last-wins", b'{"model": "pdserve-tiny", "prompt": "x", "prompt": 5}', "prompt"),
    _raw("over-4-MiB", b'{"prompt": "' + b"x" * (4 * 1024 * 1024) + b'"}', status=413,
         code="request_too_large"),
    Case("text-plain-content-type", json.dumps(OK_PROMPT).encode(), headers={"content-type": "text/plain"}),
    Case("no-content-type", json.dumps(OK_PROMPT).encode(), headers={"content-type": ""}, code="invalid_content_type"),
    Case("request-id-too-long", json.dumps(OK_PROMPT).encode(), param="X-Request-Id",
         headers={"x-request-id": "r" * 5000}),
]


def internal_errors(url: str) -> list[str]:
    """The node's counters of requests that ended in an internal error (one line per series)."""
    return [ln for ln in httpx.get(url + "/metrics").text.splitlines() if 'kind="internal"' in ln]


@pytest.fixture(scope="module")
def own_proxy(session_cluster: dict[str, Proc], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """A proxy of this module's own (its 5xx count is this module's) over the shared daemons."""
    proxy = start("proxy", tmp_path_factory.mktemp("bad-input"), *static_nodes(session_cluster))
    yield proxy
    proxy.stop()


@pytest.fixture(scope="module")
def internal_before(session_cluster: dict[str, Proc]) -> dict[str, list[str]]:
    """The shared nodes' internal-error counters before this module sent anything."""
    return {role: internal_errors(session_cluster[role].url) for role in ("prefill", "decode", "both")}


@pytest.fixture(scope="module")
def cluster(session_cluster: dict[str, Proc], own_proxy: Proc, internal_before) -> Iterator[dict[str, Proc]]:
    """The shared daemons, left idle once the whole matrix has run rather than after each case: a
    refused case can leave KV on the prefill node until its 30 s lease, and the leases of one
    module run out together."""
    yield session_cluster | {"proxy": own_proxy, "node": session_cluster["both"]}
    for role in ("prefill", "decode", "both"):
        wait_idle(session_cluster[role].url, timeout=60)


def test_the_matrix_is_large_enough() -> None:
    assert len(CASES) >= 80 and len({c.name for c in CASES}) == len(CASES)


@pytest.mark.parametrize("target", ["proxy", "node"])
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_bad_input_is_a_4xx_with_an_openai_error_body(cluster, target: str, case: Case) -> None:
    headers = {k: v for k, v in {"content-type": "application/json", **case.headers}.items() if v}  # "": none
    r = httpx.request(case.method, cluster[target].url + case.path, content=case.content, headers=headers,
                      timeout=60)
    assert r.status_code == case.status, r.text[:500]
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str)
    assert isinstance(error["code"], str) and error["code"] and not error["code"].isdigit(), error  # never null
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.code is not None:
        assert error["code"] == case.code, error
    assert "Traceback" not in r.text


def test_the_cluster_still_serves_and_no_5xx_was_answered(cluster, internal_before) -> None:
    for target in ("proxy", "node"):
        url = cluster[target].url
        reply = httpx.post(url + "/v1/completions", json=OK_PROMPT, timeout=60)
        assert reply.json()["usage"]["completion_tokens"] == 2
        assert httpx.post(url + "/v1/chat/completions", json=OK_CHAT, timeout=60).status_code == 200
    for role in ("prefill", "decode", "node"):
        wait_idle(cluster[role].url, timeout=60)  # past the KV lease a refused case may have started
    proxy_metrics = httpx.get(cluster["proxy"].url + "/metrics").text
    assert not [ln for ln in proxy_metrics.splitlines()
                if ln.startswith("pdserve:proxy_requests_total") and 'status="5' in ln]
    for role in ("prefill", "decode", "both"):  # none counted since the module began
        assert internal_errors(cluster[role].url) == internal_before[role]


def _answer(url: str, case: Case) -> tuple[int, str, str | None, str | None]:
    headers = {k: v for k, v in {"content-type": "application/json", **case.headers}.items() if v}  # "": none
    r = httpx.request(case.method, url + case.path, content=case.content, headers=headers, timeout=60)
    error = r.json()["error"]
    return r.status_code, error["type"], error["param"], error["code"]


def test_the_proxy_and_a_node_answer_each_case_alike(cluster) -> None:
    """Status, type, param and code are the same whichever door a client knocks on."""
    differ = {c.name: (_answer(cluster["proxy"].url, c), _answer(cluster["node"].url, c)) for c in CASES}
    assert {name: pair for name, pair in differ.items() if pair[0] != pair[1]} == {}
