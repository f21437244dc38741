"""Tool calls on chat: which call a request asks for (or a 400 naming why), and how the generated
text becomes OpenAI's ``tool_calls``, whole and as stream deltas that add up to the same call."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from serving_fakes import CharTokenizer, FakeEngine

from common.config import NodeConfig
from common.metrics import NodeMetrics
from common.serving.app import build_app
from common.serving.errors import OpenAIError
from common.serving.protocol import ChatCompletionRequest
from common.serving.tools import NO_ARGUMENTS, ToolCallText, plan_tool_call

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "now"}}]


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_none_and_no_tools_are_plain_text() -> None:
    assert plan_tool_call(request()) is None
    assert plan_tool_call(request(tools=TOOLS, tool_choice="none")) is None
    assert plan_tool_call(request(tool_choice="auto")) is None


def test_a_named_function_is_its_arguments_schema() -> None:
    plan = plan_tool_call(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert (plan.schema, plan.function, plan.finish_reason) == (WEATHER, "get_weather", "stop")
    now = plan_tool_call(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "now"}}))
    assert now.schema == NO_ARGUMENTS


def test_required_is_one_call_of_any_tool_name_first() -> None:
    plan = plan_tool_call(request(tools=TOOLS, tool_choice="required"))
    assert plan.function is None and plan.finish_reason == "tool_calls"
    first = plan.schema["anyOf"][0]
    assert list(first["properties"]) == ["name", "arguments"]
    assert first["properties"] == {"name": {"const": "get_weather"}, "arguments": WEATHER}


@pytest.mark.parametrize(("fields", "param"), [
    ({"tools": TOOLS}, "tool_choice"),  # auto, the default with tools: no parser of the model's format
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "other"}}}, "tool_choice"),
    ({"tools": TOOLS + TOOLS[:1], "tool_choice": "required"}, "tools"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_a_call_that_cannot_be_served_is_a_400_naming_the_field(fields: dict, param: str) -> None:
    with pytest.raises(OpenAIError) as refused:
        plan_tool_call(request(**fields))
    assert refused.value.param == param and refused.value.status == 400


def test_bad_tool_definitions_are_400s_naming_tools() -> None:
    client = TestClient(build_app(FakeEngine(), CharTokenizer(), NodeConfig(), NodeMetrics("both")),
                        raise_server_exceptions=False)
    for tools in ([{"type": "function", "function": {"name": "has space"}}], [{"type": "code"}],
                  [{"type": "function", "function": {"name": "f"}}] * 129):
        reply = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                          "tools": tools, "tool_choice": "required"})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "tools", reply.text


def _streamed(plan, pieces: list[str], finish_reason: str) -> tuple[list[dict], str]:
    text = ToolCallText(plan)
    deltas = [d for d in (text.delta(p) for p in pieces) if d is not None]
    last, reason = text.finish(finish_reason)
    return deltas + ([last] if last else []), reason


@pytest.mark.parametrize("split", [1, 3, 7, 100])
def test_a_required_call_streams_to_the_same_call_as_whole(split: int) -> None:
    plan = plan_tool_call(request(tools=TOOLS, tool_choice="required"))
    out = '{"name":"get_weather","arguments":{"city":"Paris {x}"}}'
    message, reason = ToolCallText(plan).message(out, "stop")
    call = message["tool_calls"][0]
    assert message["content"] is None and reason == "tool_calls"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris {x}"}'}
    deltas, streamed_reason = _streamed(plan, [out[i:i + split] for i in range(0, len(out), split)], "stop")
    pieces = [d["tool_calls"][0] for d in deltas]
    assert pieces[0]["function"]["name"] == "get_weather" and pieces[0]["type"] == "function"
    assert all("name" not in p["function"] and "id" not in p for p in pieces[1:])
    assert "".join(p["function"]["arguments"] for p in pieces) == call["function"]["arguments"]
    assert streamed_reason == "tool_calls"


def test_a_named_call_is_the_text_and_a_cut_one_keeps_what_it_has() -> None:
    plan = plan_tool_call(request(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    message, reason = ToolCallText(plan).message('{"city":"Oslo"}', "stop")
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city":"Oslo"}'}
    assert reason == "stop"
    required = plan_tool_call(request(tools=TOOLS, tool_choice="required"))
    cut, cut_reason = ToolCallText(required).message('{"name":"get_weather","arguments":{"city":"Os', "length")
    assert cut["tool_calls"][0]["function"]["arguments"] == '{"city":"Os' and cut_reason == "length"
    deltas, _ = _streamed(required, ['{"name":"get_weather","arguments":{"ci', 'ty":"Os'], "length")
    assert "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas) == '{"city":"Os'
    unnamed, _ = ToolCallText(required).message('{"na', "length")
    assert unnamed == {"role": "assistant", "content": '{"na'}


def test_the_chat_template_sees_the_tools() -> None:
    seen: list[dict] = []

    class ToolTemplate(CharTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=True, **kwargs):
            seen.append(kwargs)
            return super().apply_chat_template(messages, add_generation_prompt)

    client = TestClient(build_app(FakeEngine(), ToolTemplate(), NodeConfig(), NodeMetrics("both")))
    body = {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": "none", "max_tokens": 2}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    assert json.dumps(seen[0]["tools"][0]["function"]["parameters"]) == json.dumps(WEATHER)
