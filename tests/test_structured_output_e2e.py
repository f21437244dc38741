"""Structured outputs and cached-token usage through proxy -> prefill -> decode, beside a
colocated node: the embedded model has random weights, so only the grammar makes its text
JSON, and the disaggregated answer must equal the colocated one token for token (the decode
node rebuilds the grammar state from the prefill node's first token)."""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from helpers.cluster import Proc

pytestmark = pytest.mark.slow

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "role", "tags", "active"],
    "additionalProperties": False,
}
JSON_SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
WORDS = "file read write the with statement python loop class function value list dict".split()



@pytest.fixture
def cluster(shared_cluster: dict[str, Proc], always_proxy: Proc) -> dict[str, Proc]:
    return {**shared_cluster, "proxy": always_proxy}


def post(proc: Proc, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(proc.url + path, json={"model": "pdserve-tiny", **body}, timeout=120)


def chat(proc: Proc, content: str, **fields: Any) -> dict[str, Any]:
    reply = post(proc, "/v1/chat/completions", {"messages": [{"role": "user", "content": content}], **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_json_schema_answers_validate_and_equal_colocated(cluster: dict[str, Proc]) -> None:
    rng = random.Random(23)
    prompts = [" ".join(rng.choices(WORDS, k=rng.randint(3, 12))) for _ in range(20)]
    for i, prompt in enumerate(prompts):
        fields = {"response_format": JSON_SCHEMA_FORMAT, "max_tokens": 120, "temperature": 0.8, "seed": i}
        here, there = chat(cluster["both"], prompt, **fields), chat(cluster["proxy"], prompt, **fields)
        text = there["choices"][0]["message"]["content"]
        assert text == here["choices"][0]["message"]["content"], prompt
        assert there["choices"][0]["finish_reason"] == "stop"
        jsonschema.validate(json.loads(text), SCHEMA)


def test_json_object_is_parseable(cluster: dict[str, Proc]) -> None:
    for prompt in ("Give me JSON", "List three colors as JSON"):  # ones that close within max_tokens
        body = {"prompt": prompt, "max_tokens": 48, "temperature": 1.0, "seed": 0,
                "response_format": {"type": "json_object"}}
        here, there = post(cluster["both"], "/v1/completions", body), post(cluster["proxy"], "/v1/completions", body)
        choice = there.json()["choices"][0]
        assert choice["text"] == here.json()["choices"][0]["text"]
        assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["text"]), dict)


def test_without_a_format_the_same_prompt_is_not_json(cluster: dict[str, Proc]) -> None:
    text = chat(cluster["proxy"], "Give me JSON", max_tokens=24, temperature=0)["choices"][0]["message"]["content"]
    with pytest.raises(ValueError):
        json.loads(text)


@pytest.mark.parametrize(("response_format", "param"), [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties":
                                                                         {"a": {"$ref": "#/missing"}}}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"description": "x" * 70_000}}},
     "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema"),
    ({"type": "yaml"}, "response_format"),
])
def test_a_schema_the_engine_cannot_serve_is_a_400(cluster: dict[str, Proc], response_format, param: str) -> None:
    for proc in (cluster["both"], cluster["proxy"]):
        reply = post(proc, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                   "response_format": response_format})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param


def test_cached_tokens_count_the_prefix_cache(cluster: dict[str, Proc]) -> None:
    """0 on a fresh prompt, > 0 when the same long prompt comes again; streams report it too."""
    prompt = f"{uuid.uuid4().hex} " + "the with statement closes the file when the block ends. " * 12
    for proc in (cluster["both"], cluster["proxy"]):
        body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
        first = post(proc, "/v1/completions", body).json()["usage"]
        again = post(proc, "/v1/completions", body).json()["usage"]
        assert first["prompt_tokens_details"] == {"cached_tokens": 0}
        assert 0 < again["prompt_tokens_details"]["cached_tokens"] < again["prompt_tokens"]
        events = []
        with httpx.stream("POST", proc.url + "/v1/completions", timeout=120,
                          json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_openai_sdk_response_format(cluster: dict[str, Proc]) -> None:
    client = openai.OpenAI(base_url=cluster["proxy"].url + "/v1", api_key="unused")
    reply = client.chat.completions.create(
        model="pdserve-tiny", messages=[{"role": "user", "content": "Who are you?"}], max_tokens=120,
        temperature=0, response_format=JSON_SCHEMA_FORMAT)
    jsonschema.validate(json.loads(reply.choices[0].message.content), SCHEMA)
    assert reply.usage.prompt_tokens_details.cached_tokens is not None
    sampled = client.chat.completions.create(  # vLLM's sampling fields, as an SDK user sends them
        model="pdserve-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8, presence_penalty=0.5,
        frequency_penalty=0.5, logit_bias={"42": 5}, logprobs=True, top_logprobs=3,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 4})
    assert sampled.usage.completion_tokens >= 4
    assert all(len(t.top_logprobs) == 3 for t in sampled.choices[0].logprobs.content)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="pdserve-tiny", messages=[{"role": "user", "content": "hi"}],
                                       presence_penalty=2.5)
    assert caught.value.body["param"] == "presence_penalty"
