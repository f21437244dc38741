"""POST /v1/chat/completions: messages -> chat template -> token ids -> ``n`` choices."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from common.engine.outputs import RequestOutput
from common.serving.context import (DECODES_PER_TOKEN, ServingContext, get_context, request_id_of,
                                    response_headers, response_id)
from common.serving.disconnect import ClientGone, unless_disconnected
from common.serving.errors import OpenAIError, engine_error, openai_errors
from common.serving.generation import ChoiceResult, GenerationRun
from common.serving.logprobs import chat_logprobs
from common.serving.protocol import ChatCompletionRequest
from common.serving.streaming import ClosingStreamingResponse, sse_stream
from common.serving.tools import ToolCallText, ToolPlan, plan_tool_call, template_tools

router = APIRouter()


def chat_prompt_token_ids(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    """Render the template (it adds any BOS itself), then encode without special tokens."""
    if not body.messages:
        raise OpenAIError("messages is empty", param="messages", code="empty_messages")
    if tokenizer is None:
        raise OpenAIError("this model has no tokenizer, so no chat template; use /v1/completions",
                          param="messages")
    messages = [m.as_template_input() for m in body.messages]
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_tools(body))
    except Exception as exc:
        # The tokenizer raises ChatTemplateError (a template that rejects these messages,
        # or a model without one); either way the client sent something we cannot render.
        if type(exc).__name__ != "ChatTemplateError":
            raise
        raise OpenAIError(f"cannot apply the chat template: {exc}", param="messages",
                          code="chat_template_error") from exc
    return list(tokenizer.encode(text, add_special_tokens=False))


@router.post("/v1/chat/completions")
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, ctx: ServingContext = Depends(get_context)
) -> Response:
    request_id = request_id_of(request, "chatcmpl-")
    public_id = response_id(request_id, "chatcmpl-")
    headers = response_headers(request, public_id)
    with openai_errors(request_id):
        _check_logprobs(body)
        ctx.check_model(body)
        tool_plan = plan_tool_call(body)
        num_chars = sum(m.num_chars() for m in body.messages)
        ctx.check_prompt_chars(num_chars, "messages")
        prompt = await ctx.off_loop(num_chars, chat_prompt_token_ids, ctx.tokenizer, body)
        grammar = None if tool_plan is None else await ctx.response_formats.schema(tool_plan.schema, "tools")
        prepared = await ctx.prepare(body, [prompt], request, grammar)
        run = GenerationRun(ctx, prepared)
        formatter = _ChatChunks(ctx, public_id, body.logprobs, body.n, body.top_logprobs or 0, tool_plan)
        if body.stream:
            if prepared.kv_params is not None:  # a refused pull is still a 4xx (kv_params.py)
                try:
                    await unless_disconnected(run.start(), request)
                except ClientGone:
                    return Response(status_code=499)
            stream = sse_stream(run, formatter, body.include_usage, request_id, body.continuous_usage)
            return ClosingStreamingResponse(stream, headers, on_close=run.aclose)
        try:
            results = await unless_disconnected(run.collect(), request)
        except ClientGone:
            return Response(status_code=499)  # never sent: the client is gone
        failed = next((r for r in results if r.finish_reason == "error"), None)
        if failed is not None:
            raise engine_error(failed.error, failed.error_param, failed.error_code)
        choices = [await _choice(ctx, body, result, tool_plan) for result in results]
    reply = {
        "id": public_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": ctx.model_name,
        "choices": choices,
        "usage": run.usage(),
    }
    if prepared.kv_params is not None and ctx.config.role == "prefill":  # where its KV waits for a pull
        reply["kv_transfer_params"] = prepared.kv_params.reply(next(iter(results[0].token_ids), None))
    return JSONResponse(reply, headers=headers)


def _check_logprobs(body: ChatCompletionRequest) -> None:
    """``top_logprobs`` only with ``logprobs: true`` (OpenAI refuses it otherwise; ignoring it
    would answer without the logprobs the client asked for)."""
    if body.top_logprobs is not None and not body.logprobs:
        raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs",
                          code="invalid_value")
    if body.top_logprobs is not None and not 0 <= body.top_logprobs <= 20:
        raise OpenAIError("top_logprobs must be in [0, 20]", param="top_logprobs", code="invalid_value")


async def _choice(ctx: ServingContext, body: ChatCompletionRequest, result: ChoiceResult,
                  tool_plan: ToolPlan | None) -> dict[str, Any]:
    logprobs = None
    if body.logprobs:  # one decode per candidate token: a long reply's worth goes off the loop
        size = len(result.token_ids) * DECODES_PER_TOKEN * (1 + (body.top_logprobs or 0))
        logprobs = await ctx.off_loop(size, chat_logprobs, ctx.tokenizer, result.token_ids, result.logprobs,
                                      body.top_logprobs or 0)
    message, finish_reason = {"role": "assistant", "content": result.text}, result.finish_reason
    if tool_plan is not None:
        message, finish_reason = ToolCallText(tool_plan).message(result.text, result.finish_reason)
    return {"index": result.index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason}


class _ChatChunks:
    """``chat.completion.chunk`` stream chunks: a role delta first, then content deltas."""

    def __init__(self, ctx: ServingContext, request_id: str, with_logprobs: bool, n: int = 1,
                 top_logprobs: int = 0, tool_plan: ToolPlan | None = None) -> None:
        self.ctx = ctx
        self.with_logprobs = with_logprobs
        self.top_logprobs = top_logprobs
        # a tool call: each choice's text becomes tool_calls deltas
        self.tool_calls = [ToolCallText(tool_plan) for _ in range(n)] if tool_plan is not None else None
        self.n = n
        self.base = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": ctx.model_name,
        }

    def _chunk(self, delta: dict[str, Any], finish_reason: str | None,
               logprobs: Any = None, index: int = 0) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return {**self.base, "choices": [choice]}

    def opening(self) -> list[dict[str, Any]]:
        return [self._chunk({"role": "assistant", "content": ""}, None, index=i) for i in range(self.n)]

    def delta(self, index: int, out: RequestOutput) -> dict[str, Any] | None:
        delta: dict[str, Any] | None = {"content": out.new_text} if out.new_text else None
        if self.tool_calls is not None:
            delta = self.tool_calls[index].delta(out.new_text)
        if delta is None and not (self.with_logprobs and out.new_token_ids):
            return None
        logprobs = None
        if self.with_logprobs:
            logprobs = chat_logprobs(self.ctx.tokenizer, out.new_token_ids, out.new_logprobs or [],
                                     self.top_logprobs)
        return self._chunk(delta or ({} if self.tool_calls is not None else {"content": ""}), None, logprobs, index)

    def finish(self, index: int, finish_reason: str) -> dict[str, Any]:
        if self.tool_calls is None:
            return self._chunk({}, finish_reason, index=index)
        last, finish_reason = self.tool_calls[index].finish(finish_reason)
        return self._chunk(last or {}, finish_reason, index=index)

    def usage(self, usage: dict[str, int]) -> dict[str, Any]:
        return {**self.base, "choices": [], "usage": usage}
