"""Resuming a request on another node (the proxy's migration), the node's half.

A pdserve proxy that streams a request asks, with ``TOKEN_IDS_HEADER``, for the token ids
behind each event: the node puts them in an SSE comment line (``TOKEN_IDS_NOTE``) in the same
event as the text they produced, which the proxy strips before relaying. Clients and other
proxies (vLLM's) never send the header and see the usual bytes.

When the node answering dies, the proxy re-sends the client's body with ``RESUME_FIELD``: the
ids it already streamed. The node tokenizes the prompt as before, appends those ids, and
generates on from there; its text stream replays them unseen (``resumed_tokens``), so the client
gets the next token's text, and seeded sampling (keyed on seed and position) the same tokens.
"""

from __future__ import annotations

from typing import Any

from common.engine.sampling_params import SamplingParams
from common.request_id import Tags
from common.serving.errors import OpenAIError

TOKEN_IDS_HEADER = "x-pdserve-token-ids"
TOKEN_IDS_NOTE = ": pdserve-ids "  # then "<choice index> <id>,<id>,...": an SSE comment line
RESUME_FIELD = "pdserve_resume_token_ids"


def resumed_prompts(resume_ids: list[int] | None, prompts: list[list[int]], params: SamplingParams,
                    tags: Tags | None) -> list[list[int]]:
    """``prompts`` with a migrated request's earlier output appended (noted in ``params``)."""
    if not resume_ids:
        return prompts
    if tags is None or len(prompts) != 1:
        raise OpenAIError(f"{RESUME_FIELD} is for a pdserve proxy's requests (a tagged X-Request-Id, one prompt)",
                          param=RESUME_FIELD,
                          code="invalid_value")
    params.resumed_tokens = len(resume_ids)
    return [prompts[0] + list(resume_ids)]


def token_ids_note(wanted: bool, index: int, new_token_ids: list[int]) -> str:
    """The comment line naming the ids behind an event's text, when the proxy asked for it."""
    if not wanted or not new_token_ids:
        return ""
    return f"{TOKEN_IDS_NOTE}{index} {','.join(map(str, new_token_ids))}\n"


def wants_token_ids(headers: Any) -> bool:
    return headers.get(TOKEN_IDS_HEADER) == "1"
