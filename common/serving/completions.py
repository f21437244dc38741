"""POST /v1/completions: text or token-id prompts, one choice per prompt."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from common.engine.outputs import RequestOutput
from common.serving.context import ServingContext, get_context, request_id_of
from common.serving.errors import REQUEST_ID_HEADER, OpenAIError, engine_error, openai_errors
from common.serving.generation import ChoiceResult, GenerationRun
from common.serving.logprobs import completion_logprobs
from common.serving.protocol import CompletionRequest, Prompt
from common.serving.streaming import ClosingStreamingResponse, sse_stream

router = APIRouter()


def prompt_token_ids(tokenizer: Any, prompt: Prompt) -> list[list[int]]:
    """One token-id list per prompt, whichever of the four OpenAI forms was sent."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise OpenAIError("prompt is empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    prompts: list[list[int]] = []
    for item in prompt:
        if isinstance(item, str):
            if not item:
                raise OpenAIError("prompt is empty", param="prompt")
            if tokenizer is None:
                raise OpenAIError("this model has no tokenizer; send the prompt as token ids", param="prompt")
            prompts.append(list(tokenizer.encode(item, add_special_tokens=True)))
        else:
            prompts.append(list(item))
    return prompts


@router.post("/v1/completions")
async def create_completion(
    body: CompletionRequest, request: Request, ctx: ServingContext = Depends(get_context)
) -> Response:
    request_id = request_id_of(request)
    headers = {REQUEST_ID_HEADER: request_id}
    with openai_errors(request_id):
        ctx.check_model(body)
        if body.echo:
            raise OpenAIError("echo is not supported", param="echo")
        prepared = await ctx.prepare(body, prompt_token_ids(ctx.tokenizer, body.prompt), request)
        run = GenerationRun(ctx, prepared)
        formatter = _CompletionChunks(ctx, request_id, body.logprobs is not None)
        if body.stream:
            return ClosingStreamingResponse(sse_stream(run, formatter, body.include_usage, request_id), headers)
        results = await run.collect()
        failed = next((r for r in results if r.finish_reason == "error"), None)
        if failed is not None:
            raise engine_error(failed.error)
        choices = [_choice(ctx, r, body.logprobs is not None) for r in results]
    reply = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": choices,
        "usage": run.usage(),
    }
    return JSONResponse(reply, headers=headers)


def _choice(ctx: ServingContext, result: ChoiceResult, with_logprobs: bool) -> dict[str, Any]:
    logprobs = completion_logprobs(ctx.tokenizer, result.token_ids, result.logprobs) if with_logprobs else None
    return {"index": result.index, "text": result.text, "logprobs": logprobs, "finish_reason": result.finish_reason}


class _CompletionChunks:
    """``text_completion`` stream chunks."""

    def __init__(self, ctx: ServingContext, request_id: str, with_logprobs: bool) -> None:
        self.ctx = ctx
        self.with_logprobs = with_logprobs
        self.base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": ctx.model_name}
        self.text_offsets: dict[int, int] = {}

    def _chunk(self, index: int, text: str, finish_reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self.base, "choices": [choice]}

    def opening(self) -> list[dict[str, Any]]:
        return []

    def delta(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        if not out.new_text and not (self.with_logprobs and out.new_token_ids):
            return None
        logprobs = None
        if self.with_logprobs:
            offset = self.text_offsets.get(index, 0)
            logprobs = completion_logprobs(self.ctx.tokenizer, out.new_token_ids, out.new_logprobs or [], offset)
        self.text_offsets[index] = self.text_offsets.get(index, 0) + len(out.new_text)
        return self._chunk(index, out.new_text, None, logprobs)

    def finish(self, index: int, finish_reason: str) -> dict[str, Any]:
        return self._chunk(index, "", finish_reason)

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage}
