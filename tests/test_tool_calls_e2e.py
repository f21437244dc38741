"""Tool calls through proxy -> prefill -> decode beside a colocated node, with the openai SDK: the
embedded model has random weights, so only the grammar makes its arguments valid under the
function's schema; the disaggregated call equals the colocated one (the prefill node's first
token obeys the same grammar), streamed and not."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import openai
import pytest

from helpers.cluster import Proc

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["celsius", "fahrenheit"]},
                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 20}}, "required": ["query"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "parameters": SEARCH}}]
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
CHOICES = {"required": "required", "named": {"type": "function", "function": {"name": "get_weather"}}}



@pytest.fixture
def clients(shared_cluster: dict[str, Proc], always_proxy: Proc) -> dict[str, openai.OpenAI]:
    return {name: openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)
            for name, proc in (("colocated", shared_cluster["both"]), ("disaggregated", always_proxy))}


def create(client: openai.OpenAI, choice: Any, **fields: Any) -> Any:
    return client.chat.completions.create(model="pdserve-tiny", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                          **{"max_tokens": 80, **fields})


def streamed_call(client: openai.OpenAI, choice: Any, **fields: Any) -> tuple[str, str, str, str]:
    """(id, name, arguments, finish reason) put together from the stream's deltas."""
    call_id = name = arguments = reason = ""
    for chunk in create(client, choice, stream=True, **fields):
        for c in chunk.choices:
            assert not c.delta.content  # a tool call's text is never content
            for call in c.delta.tool_calls or []:
                call_id, name = call.id or call_id, (call.function.name or name)
                arguments += call.function.arguments or ""
            reason = c.finish_reason or reason
    return call_id, name, arguments, reason


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("kind", list(CHOICES))
def test_a_tool_call_validates_and_equals_colocated_streamed_or_not(clients: dict, kind: str, seed: int) -> None:
    fields = {"temperature": 0.9, "seed": seed}
    replies = {where: create(client, CHOICES[kind], **fields) for where, client in clients.items()}
    calls = {where: r.choices[0].message.tool_calls for where, r in replies.items()}
    assert len(calls["colocated"]) == 1 and replies["colocated"].choices[0].message.content is None
    call = calls["colocated"][0]
    assert (call.type, call.id.startswith("call_")) == ("function", True)
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    if kind == "named":
        assert call.function.name == "get_weather"
    other = calls["disaggregated"][0]
    assert (other.function.name, other.function.arguments) == (call.function.name, call.function.arguments)
    reason = "stop" if kind == "named" else "tool_calls"
    assert {r.choices[0].finish_reason for r in replies.values()} == {reason}
    for client in clients.values():
        call_id, name, arguments, streamed_reason = streamed_call(client, CHOICES[kind], **fields)
        assert (name, arguments, streamed_reason) == (call.function.name, call.function.arguments, reason)
        assert call_id.startswith("call_")


def test_none_answers_in_text_and_auto_is_refused(clients: dict) -> None:
    text = create(clients["disaggregated"], "none", temperature=0, max_tokens=8).choices[0].message
    assert text.tool_calls is None and text.content
    with pytest.raises(openai.BadRequestError) as refused:
        create(clients["disaggregated"], "auto")
    assert refused.value.body["param"] == "tool_choice"
