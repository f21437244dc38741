"""Function tools on /v1/chat/completions: ``tools`` with ``tool_choice`` none, required or named.

A request's life through here:

1. :func:`plan_tool_call` reads ``tools`` / ``tool_choice``: no tools or ``"none"`` is plain
   text; a named function makes the whole output that function's arguments, constrained by
   the grammar engine to its ``parameters`` schema; ``"required"`` makes it one call
   ``{"name":"<a tool>","arguments":{...}}``, name first (llguidance keeps the schema's
   property order and compact JSON), each tool's arguments under its own schema. ``"auto"``
   with tools is a 400: it would need a parser of the model's own tool-call format, and none
   is implemented. The plan's schema compiles like ``response_format`` on every node that gets
   the body, so a prefill node's first token obeys it as the decode node's rest.
2. the chat template is rendered with ``tools`` (templates that describe them to the model do).
3. :class:`ToolCallText` turns the generated text into OpenAI's ``tool_calls``: whole, or as
   stream deltas (the call's id and name once they are known, then argument text).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.serving.errors import OpenAIError
from common.serving.protocol import ChatCompletionRequest, Tool

NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}
_CALL_PREFIX = re.compile(r'\{"name":"([a-zA-Z0-9_-]{1,64})","arguments":')


@dataclass(frozen=True)
class ToolPlan:
    """What the output must be: one named function's arguments, or one call of any tool."""

    schema: dict[str, Any]
    function: str | None  # the named function; None: "required" (the output names it)

    @property
    def finish_reason(self) -> str:
        """OpenAI's: "tool_calls" when the model chose to call, "stop" for a forced function."""
        return "stop" if self.function is not None else "tool_calls"


def plan_tool_call(body: ChatCompletionRequest) -> ToolPlan | None:
    """The call ``body`` asks for, or None for plain text; a 400 naming the field otherwise."""
    choice, tools = body.tool_choice, body.tools or []
    if choice is None or choice == "auto":
        if not tools:
            return None
        raise OpenAIError("tool_choice 'auto' (the default when tools are given) needs a parser for the model's "
                          "own tool-call format, and this server has none; send tool_choice 'required' or "
                          "{'type': 'function', 'function': {'name': ...}}, or 'none'",
                          param="tool_choice", code="unsupported_value")
    if choice == "none":
        return None
    if not tools:
        raise OpenAIError("tool_choice asks for a tool call but tools is empty", param="tools", code="missing_field")
    if len({t.function.name for t in tools}) != len(tools):
        raise OpenAIError("two tools have the same function name", param="tools", code="invalid_value")
    if body.response_format is not None and body.response_format.type != "text":
        raise OpenAIError("response_format cannot be combined with a tool call (its arguments have their own "
                          "schema)", param="response_format", code="unsupported_value")
    if choice == "required":
        calls = [_call_schema(t) for t in tools]
        return ToolPlan(calls[0] if len(calls) == 1 else {"anyOf": calls}, None)
    named = next((t for t in tools if t.function.name == choice.function.name), None)
    if named is None:
        raise OpenAIError(f"tool_choice names function '{choice.function.name}', which is not in tools",
                          param="tool_choice", code="invalid_value")
    return ToolPlan(_arguments_schema(named), named.function.name)


def template_tools(body: ChatCompletionRequest) -> dict[str, Any]:
    """``tools`` for the chat template, as the OpenAI-shaped dicts templates expect (none: no kwarg)."""
    if not body.tools:
        return {}
    return {"tools": [t.model_dump(exclude_none=True) for t in body.tools]}


def _arguments_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_ARGUMENTS


def _call_schema(tool: Tool) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                             "arguments": _arguments_schema(tool)},
            "required": ["name", "arguments"], "additionalProperties": False}


@dataclass
class ToolCallText:
    """One choice's generated text read as a tool call (the plan's shape), whole or piece by piece.

    A "required" call's text ends with the call object's closing brace, which is not part of
    the arguments: streamed, the last character is held back until the next piece shows it was
    not the end; at the end it is dropped unless the output was cut short (``length``).
    """

    plan: ToolPlan
    call_id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    _text: str = ""
    _sent: int = 0  # characters of arguments already streamed
    _named: bool = False  # the stream has sent the call's id and name

    def message(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """The non-stream ``message`` and finish reason; the text as content if no call can be read."""
        call = self._parse(text, hold_back=finish_reason != "length")
        if call is None:
            return {"role": "assistant", "content": text}, finish_reason
        name, arguments = call
        calls = [{"id": self.call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]
        return {"role": "assistant", "content": None, "tool_calls": calls}, self._reason(finish_reason)

    def delta(self, new_text: str) -> dict[str, Any] | None:
        """The stream delta for ``new_text`` (None: nothing to send yet)."""
        self._text += new_text
        return self._piece(hold_back=True)

    def finish(self, finish_reason: str) -> tuple[dict[str, Any] | None, str]:
        """The last delta (what was held back, when the output was cut short) and the finish reason."""
        return self._piece(hold_back=finish_reason != "length"), self._reason(finish_reason)

    def _reason(self, finish_reason: str) -> str:
        return finish_reason if finish_reason == "length" else self.plan.finish_reason

    def _piece(self, hold_back: bool) -> dict[str, Any] | None:
        call = self._parse(self._text, hold_back)
        if call is None:
            return None
        name, arguments = call
        piece: dict[str, Any] = {"index": 0, "function": {"arguments": arguments[self._sent:]}}
        self._sent = max(self._sent, len(arguments))
        if not self._named:
            self._named = True
            piece.update(id=self.call_id, type="function", function={"name": name, **piece["function"]})
        elif not piece["function"]["arguments"]:
            return None
        return {"tool_calls": [piece]}

    def _parse(self, text: str, hold_back: bool) -> tuple[str, str] | None:
        """(name, arguments so far), or None while a "required" call's name is not complete."""
        if self.plan.function is not None:
            return self.plan.function, text
        match = _CALL_PREFIX.match(text)
        if match is None:
            return None
        arguments = text[match.end():]
        return match.group(1), arguments[:-1] if hold_back else arguments
