"""Request fields pdserve knows but does not act on: refused unless they ask for nothing.

OpenAI and vLLM clients send fields this server does not implement. A field sent at its
neutral value (``functions: []``, ``length_penalty: 1.0``) changes nothing, so it is accepted;
any other value would be silently ignored, so it is a 400 naming the field. A few fields are
accepted whatever their value because ignoring them is what they mean here (``IGNORED``, with
the reason). Names in neither table are ignored as before (vLLM does the same), so a client
that adds a new field keeps working; the README lists all three groups.
"""

from __future__ import annotations

import json
from typing import Any

from common.serving.errors import OpenAIError

_NONE: tuple[Any, ...] = (None,)
_EMPTY: tuple[Any, ...] = (None, [], {}, "")

# field -> the values that ask for nothing (accepted as a no-op); anything else is a 400
REFUSED: dict[str, tuple[Any, ...]] = {
    # OpenAI
    "functions": _EMPTY,
    "function_call": (None, "none", "auto"),
    "suffix": _EMPTY,
    "service_tier": (None, "auto", "default"),  # one tier here
    "store": (None, False),  # nothing is stored for later retrieval
    "modalities": (None, ["text"]),
    "audio": _NONE,
    "prediction": _NONE,
    "reasoning_effort": _NONE,
    "verbosity": _NONE,
    "web_search_options": _NONE,
    # vLLM's extensions
    "length_penalty": (None, 1, 1.0),
    "use_beam_search": (None, False),
    "include_stop_str_in_output": (None, False),
    "skip_special_tokens": (None, True),
    "spaces_between_special_tokens": (None, True),
    "prompt_logprobs": (None, 0),
    "allowed_token_ids": _NONE,
    "bad_words": _EMPTY,
    "truncate_prompt_tokens": _NONE,
    "add_generation_prompt": (None, True),
    "continue_final_message": (None, False),
    "add_special_tokens": (None, False),
    "chat_template": _EMPTY,
    "chat_template_kwargs": _EMPTY,
    "documents": _EMPTY,
    "guided_json": _NONE,  # structured outputs go through response_format
    "guided_regex": _NONE,
    "guided_choice": _NONE,
    "guided_grammar": _NONE,
    "guided_decoding_backend": _NONE,
    "guided_whitespace_pattern": _NONE,
    "structured_outputs": _NONE,
    "return_tokens_as_token_ids": (None, False),
    "logits_processors": _EMPTY,
    "priority": (None, 0),
}
REFUSED_CHAT = {"echo": (None, False)}  # vLLM's chat echo; completions' echo is refused in its route
REFUSED_COMPLETIONS = {  # chat fields
    "top_logprobs": (None, 0),  # completions take ``logprobs: N``
    "tools": _EMPTY,  # chat's ``tools`` are served by common.serving.tools
    "tool_choice": (None, "none", "auto"),  # without tools both mean plain text
}

# accepted with any value: ignoring them is what they mean here
IGNORED: dict[str, str] = {
    "user": "an end-user id for the provider's abuse monitoring; nothing here is per user",
    "safety_identifier": "the same as user",
    "metadata": "tags for stored completions; nothing is stored",
    "parallel_tool_calls": "a tool call here is always one call (tool_choice required or a named function)",
    "prompt_cache_key": "a routing hint for OpenAI's cache; the prefix cache here keys on the tokens",
    "request_id": "vLLM's; the id is X-Request-Id (or generated), which P and D must share",
}


def check_unhonoured(extra: dict[str, Any] | None, chat: bool) -> None:
    """400 naming the first field in ``extra`` (the body's undeclared fields) that asks for
    something this server would silently skip."""
    table = {**REFUSED, **(REFUSED_CHAT if chat else REFUSED_COMPLETIONS)}
    for name, value in (extra or {}).items():
        neutral = table.get(name)
        if neutral is not None and not _neutral(value, neutral):
            raise OpenAIError(f"{name} is not supported by this server; leave it out (or {_show(neutral)}, "
                              "which asks for nothing)", param=name, code="unsupported_parameter")


def _neutral(value: Any, neutral: tuple[Any, ...]) -> bool:
    for n in neutral:
        if n is None or isinstance(n, bool) or isinstance(value, bool):
            if value is n or (type(value) is type(n) and value == n):  # True is not 1, False not 0
                return True
        elif value == n:  # 0 == 0.0, [] == [], "auto"
            return True
    return False


def _show(neutral: tuple[Any, ...]) -> str:
    return " or ".join(json.dumps(n) for n in neutral if n is not None) or "null"
