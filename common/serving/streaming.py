"""Server-sent events for streaming replies, with a guaranteed abort on disconnect.

Every stream ends with ``data: [DONE]``. Starlette stops iterating a body when the
client goes away but does not promise to close the generator at once; the response
here closes it itself, so the ``finally`` that aborts engine requests always runs
before the response is done.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any, Protocol

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from common.engine.outputs import RequestOutput
from common.serving.errors import OpenAIError, engine_error, internal_error
from common.serving.generation import GenerationRun
from common.serving.resume import token_ids_note

logger = logging.getLogger(__name__)

DONE_EVENT = "data: [DONE]\n\n"


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, separators=(',', ':'))}\n\n"


class ClosingStreamingResponse(StreamingResponse):
    """A ``text/event-stream`` response that always closes its body generator."""

    def __init__(self, content: Any, headers: dict[str, str] | None = None,
                 on_close: Callable[[], Awaitable[None]] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers=headers)
        self.headers["Cache-Control"] = "no-cache"
        self.on_close = on_close  # also run at the end: e.g. a run started before the body (GenerationRun.start)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()
            if self.on_close is not None:
                await self.on_close()


class ChunkFormatter(Protocol):
    """How one endpoint (completions, chat) shapes its stream chunks."""

    def opening(self) -> list[dict[str, Any]]: ...

    def delta(self, index: int, out: RequestOutput) -> dict[str, Any] | None: ...

    def finish(self, index: int, finish_reason: str) -> dict[str, Any]: ...

    def usage(self, usage: dict[str, int]) -> dict[str, Any]: ...


async def sse_stream(
    run: GenerationRun, formatter: ChunkFormatter, include_usage: bool, request_id: str,
    continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """Opening chunks, a chunk per output, a finish chunk per choice, usage, ``[DONE]``.

    ``continuous_usage`` (vLLM's ``continuous_usage_stats``) adds the usage so far to
    every chunk. An engine error or an unexpected exception becomes one
    ``data: {"error": ...}`` event; closing the generator early (client gone) closes
    ``run.events()``, which aborts.
    """
    failed = False

    def event(chunk: dict[str, Any]) -> str:
        return sse_event({**chunk, "usage": run.usage()} if continuous_usage else chunk)

    try:
        for chunk in formatter.opening():
            yield event(chunk)
        async with aclosing(run.events()) as events:
            async for index, out in events:
                if out.finish_reason == "error":
                    error = engine_error(out.error, out.error_param, out.error_code)
                    if out.error_param is not None:  # a node's fault was counted by the run
                        run.ctx.metrics.observe_error("invalid_request")
                    error.request_id = request_id  # its body never shows the routing tag
                    yield sse_event(error.body())
                    failed = True
                    break
                # the ids go in the same write as their text (and a last token's finish): a proxy
                # that resumes the request elsewhere knows exactly what the client has
                note = token_ids_note(run.prepared.stream_token_ids, index, out.new_token_ids)
                chunk = formatter.delta(index, out)
                events = [event(chunk)] if chunk is not None else []
                if out.finished:
                    events.append(event(formatter.finish(index, out.finish_reason or "stop")))
                if events or note:
                    yield note + ("".join(events) or "\n")
        if include_usage and not failed:
            yield sse_event(formatter.usage(run.usage()))
    except OpenAIError as exc:
        run.ctx.metrics.observe_error("invalid_request")
        exc.request_id = exc.request_id or request_id
        yield sse_event(exc.body())
    except Exception:
        logger.exception("stream failed (request id %s)", request_id)
        run.ctx.metrics.observe_error("internal")
        yield sse_event(internal_error(request_id).body())
    yield DONE_EVENT
