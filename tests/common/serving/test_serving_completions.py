"""/v1/completions and /v1/chat/completions over a scripted engine: forms, usage, bad input."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from serving_fakes import CharTokenizer, FakeEngine

from common.config import NodeConfig
from common.metrics import NodeMetrics
from common.serving.app import build_app
from common.serving.logprobs import chat_logprobs


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(engine: FakeEngine) -> TestClient:
    app = build_app(engine, CharTokenizer(), NodeConfig(), NodeMetrics("both"))
    return TestClient(app, raise_server_exceptions=False)


def _complete(client: TestClient, **body: Any) -> Any:
    return client.post("/v1/completions", json={"model": "fake-model", **body})


def test_string_prompt_usage_and_text(client: TestClient, engine: FakeEngine) -> None:
    reply = _complete(client, prompt="hi", max_tokens=3, temperature=0)
    assert reply.status_code == 200
    data = reply.json()
    assert data["object"] == "text_completion" and data["model"] == "fake-model"
    assert data["choices"] == [{"index": 0, "text": "abc", "logprobs": None, "finish_reason": "length"}]
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 0}}
    assert engine.calls[0].prompt_token_ids == [1, ord("h"), ord("i")]
    assert engine.calls[0].params.greedy


def test_default_max_tokens_is_16(client: TestClient) -> None:
    assert _complete(client, prompt="hi").json()["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize(
    ("prompt", "expected_prompts"),
    [
        (["ab", "c"], [[1, 97, 98], [1, 99]]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5, 6], [7]], [[5, 6], [7]]),
    ],
)
def test_prompt_forms_give_one_choice_per_prompt(
    client: TestClient, engine: FakeEngine, prompt: Any, expected_prompts: list[list[int]]
) -> None:
    data = _complete(client, prompt=prompt, max_tokens=2).json()
    assert [c["index"] for c in data["choices"]] == list(range(len(expected_prompts)))
    assert all(c["text"] == "ab" for c in data["choices"])
    assert sorted(call.prompt_token_ids for call in engine.calls) == sorted(expected_prompts)
    n_prompt = sum(len(p) for p in expected_prompts)
    assert data["usage"] == {"prompt_tokens": n_prompt, "completion_tokens": 2 * len(expected_prompts),
                             "total_tokens": n_prompt + 2 * len(expected_prompts),
                             "prompt_tokens_details": {"cached_tokens": 0}}


def test_sampling_fields_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    body = dict(prompt="x", max_tokens=2, temperature=0.7, top_p=0.9, top_k=5, seed=3, stop="zz",
                stop_token_ids=[9], ignore_eos=True, user="someone")
    assert _complete(client, **body).status_code == 200
    params = engine.calls[0].params
    assert (params.temperature, params.top_p, params.top_k, params.seed) == (0.7, 0.9, 5, 3)
    assert (params.stop, params.stop_token_ids, params.ignore_eos) == (["zz"], [9], True)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_sampling_fields_reach_the_engine(client: TestClient, engine: FakeEngine, path: str) -> None:
    fields = dict(presence_penalty=0.5, frequency_penalty=-1, repetition_penalty=1.3, min_p=0.05, top_k=7,
                  min_tokens=2, logit_bias={"5": 10, "255": -100.0}, max_tokens=4)
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    assert client.post(path, json={**body, **fields}).status_code == 200
    p = engine.calls[0].params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (0.5, -1.0, 1.3, 0.05)
    assert (p.top_k, p.min_tokens, p.logit_bias) == (7, 2, {5: 10.0, 255: -100.0})


def test_logprobs(client: TestClient) -> None:
    data = _complete(client, prompt="x", max_tokens=2, logprobs=1).json()
    logprobs = data["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a", "b"] and logprobs["token_logprobs"] == [-0.5, -0.5]
    assert logprobs["top_logprobs"][0] == {"a": -0.5, "b": -1.5} and logprobs["text_offset"] == [0, 1]


def test_chat_completion(client: TestClient, engine: FakeEngine) -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    reply = client.post("/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 2,
                                                      "logprobs": True, "top_logprobs": 1})
    assert reply.status_code == 200
    data = reply.json()
    assert data["object"] == "chat.completion"
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "ab"}
    assert data["choices"][0]["logprobs"]["content"][0]["token"] == "a"
    assert [len(e["top_logprobs"]) for e in data["choices"][0]["logprobs"]["content"]] == [1, 1]
    expected = list(b"<system>s\n<user>hi\n<assistant>")  # add_special_tokens=False: no BOS
    assert engine.calls[0].prompt_token_ids == expected
    assert data["usage"]["prompt_tokens"] == len(expected)


def test_chat_top_logprobs_leave_out_a_sampled_token_outside_the_top_n() -> None:
    """The engine's map holds the top N plus the sampled token; chat reports exactly N."""
    candidates = {ord("x"): -0.2, ord("y"): -0.9, ord("a"): -3.0}  # "a" sampled, third most likely
    entry = chat_logprobs(CharTokenizer(), [ord("a")], [candidates], 2)["content"][0]
    assert entry["logprob"] == -3.0
    assert [(t["token"], t["logprob"]) for t in entry["top_logprobs"]] == [("x", -0.2), ("y", -0.9)]
    assert chat_logprobs(CharTokenizer(), [ord("a")], [candidates], 0)["content"][0]["top_logprobs"] == []


@pytest.mark.parametrize("fields", [{"top_logprobs": 2}, {"top_logprobs": 0, "logprobs": False},
                                    {"top_logprobs": 21, "logprobs": True}])
def test_chat_top_logprobs_need_logprobs_and_a_range(client: TestClient, fields: dict) -> None:
    reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], **fields})
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "top_logprobs"


BAD_COMPLETIONS = [
    ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ({"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    ({"prompt": "x", "temperature": 3.0}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": "x", "n": 17}, "n"),  # past --max-n (16)
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "n": 2, "best_of": 3}, "best_of"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [5, 999]}, "prompt"),
    ({"prompt": [True]}, "prompt"),
    ({"prompt": "x" * 60, "max_tokens": 10}, "max_tokens"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ({"prompt": "x", "frequency_penalty": -2.01}, "frequency_penalty"),
    ({"prompt": "x", "frequency_penalty": "1"}, "frequency_penalty"),
    ({"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ({"prompt": "x", "repetition_penalty": -1.0}, "repetition_penalty"),
    ({"prompt": "x", "min_p": 1.5}, "min_p"),
    ({"prompt": "x", "min_p": -0.1}, "min_p"),
    ({"prompt": "x", "top_k": -2}, "top_k"),
    ({"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"256": 1}}, "logit_bias"),  # past the vocabulary (256)
    ({"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"-1": 1}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {"5": "1"}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ({"prompt": "x", "logit_bias": [5]}, "logit_bias"),
    ({"prompt": "x", "min_tokens": -1}, "min_tokens"),
    ({"prompt": "x", "min_tokens": 5, "max_tokens": 4}, "min_tokens"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS)
def test_bad_completion_gets_400_and_server_keeps_serving(client: TestClient, body: dict, param: str) -> None:
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]
    assert _complete(client, prompt="ok", max_tokens=1).status_code == 200


def test_unknown_model_is_404_model_not_found(client: TestClient) -> None:
    reply = _complete(client, prompt="x", model="gpt-4")
    assert reply.status_code == 404
    assert reply.json()["error"] | {"message": ""} == {
        "message": "", "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


def test_error_messages_say_what_is_wrong(client: TestClient) -> None:
    too_long = _complete(client, prompt="x" * 60, max_tokens=10).json()["error"]["message"]
    assert "64" in too_long and "61" in too_long and "10" in too_long
    unknown = _complete(client, prompt="x", model="gpt-4").json()["error"]["message"]
    assert "gpt-4" in unknown and "fake-model" in unknown


@pytest.mark.parametrize(
    "raw", [b"{not json", b"[1, 2]", b'{"messages": "hi"}', b'{"messages": [{"role": "alien", "content": "x"}]}']
)
def test_malformed_chat_bodies_get_400(client: TestClient, raw: bytes) -> None:
    reply = client.post("/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["type"] == "invalid_request_error"


def test_chat_template_error_and_empty_messages_get_400(client: TestClient) -> None:
    tool = client.post("/v1/chat/completions", json={"messages": [{"role": "tool", "content": "x"}]})
    assert tool.status_code == 400 and "chat template" in tool.json()["error"]["message"]
    empty = client.post("/v1/chat/completions", json={"messages": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "messages"


def test_engine_error_is_502_with_its_message(engine: FakeEngine, client: TestClient) -> None:
    engine.error = "KV transfer from 10.0.0.1:14579 timed out"
    reply = _complete(client, prompt="x", max_tokens=4)
    assert reply.status_code == 502
    assert reply.json()["error"]["message"] == "KV transfer from 10.0.0.1:14579 timed out"


def test_unexpected_exception_is_500_without_traceback(engine: FakeEngine, client: TestClient) -> None:
    def explode(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("secret internals")

    engine.generate = explode  # type: ignore[method-assign]
    reply = client.post("/v1/completions", json={"prompt": "x"}, headers={"X-Request-Id": "req-500"})
    assert reply.status_code == 500
    assert "secret" not in reply.text and "Traceback" not in reply.text
    assert "req-500" in reply.json()["error"]["message"]
    assert reply.headers["X-Request-Id"] == "req-500"
