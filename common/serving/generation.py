"""Running a prepared request on the engine: one engine request per prompt, which yields
its ``n`` choices (the engine forks them after one prompt pass), metrics on every output,
and an abort for every choice that is left unfinished when the consumer stops listening
(client gone, error, server shutdown). Choice ``i`` of prompt ``p`` is ``p * n + i``, as
OpenAI numbers them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

from common.engine.outputs import RequestOutput
from common.serving.context import PreparedRequest, ServingContext
from common.serving.errors import OpenAIError, engine_error

logger = logging.getLogger(__name__)


@dataclass
class ChoiceResult:
    """Everything one choice produced, for the non-streaming reply."""

    index: int
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_param: str | None = None  # the error is the request's own: this field is at fault
    error_code: str | None = None  # a node's error: where it came from (RequestOutput.error_code)
    num_prompt_tokens: int = 0

    @property
    def text(self) -> str:
        return "".join(self.text_parts)


@dataclass
class _Timing:
    first_token_at: float | None = None
    last_token_at: float | None = None


class GenerationRun:
    """Iterate ``events()`` (streaming) or await ``collect()`` (whole reply), once."""

    def __init__(self, ctx: ServingContext, prepared: PreparedRequest) -> None:
        self.ctx = ctx
        self.prepared = prepared
        self.num_prompt_tokens = sum(len(p) for p in prepared.prompts)
        self.num_output_tokens = 0
        self.n = prepared.params.n  # choices per prompt: choice index = prompt index * n + the engine's index
        self._timings = [_Timing() for _ in range(len(prepared.prompts) * self.n)]
        self._cached_tokens: dict[int, int] = {}  # per prompt: tokens its node found in the prefix cache
        self._started: tuple[AsyncIterator[tuple[int, RequestOutput]], tuple[int, RequestOutput] | None] | None = None

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.num_prompt_tokens,
            "completion_tokens": self.num_output_tokens,
            "total_tokens": self.num_prompt_tokens + self.num_output_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self._cached_tokens.values())},
        }

    async def start(self) -> None:
        """Wait for the first output before a stream's reply begins, so that what fails before it (a
        ``kv_transfer_params`` pull the prefill node refuses, a prefill node gone) is still an HTTP
        error, as it is without a stream. ``events()`` then yields it first; ``aclose()`` if the
        reply never runs."""
        events = self.events()
        try:
            first = await anext(events, None)
        except BaseException:
            await events.aclose()  # type: ignore[attr-defined]
            raise
        self._started = (events, first)
        if first is not None and first[1].finish_reason == "error":
            await self.aclose()
            out = first[1]
            raise engine_error(out.error, out.error_param, out.error_code)

    async def aclose(self) -> None:
        """Stop what ``start()`` began (aborting unfinished choices) when nobody reads ``events()``."""
        started, self._started = self._started, None
        if started is not None:
            await started[0].aclose()  # type: ignore[attr-defined]

    async def events(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """``(choice index, output)`` pairs in arrival order until every choice finished."""
        if self._started is not None:  # start() took the first one
            (started, first), self._started = self._started, None
            async with aclosing(started) as outputs:  # type: ignore[type-var]
                if first is not None:
                    yield first
                async for item in outputs:
                    yield item
            return
        if len(self.prepared.prompts) == 1:
            async with aclosing(self._choices(0)) as outputs:
                async for item in outputs:
                    yield item
            return
        async for item in self._merged():
            yield item

    async def collect(self) -> list[ChoiceResult]:
        results = [ChoiceResult(i) for i in range(len(self._timings))]
        async with aclosing(self.events()) as events:
            async for index, out in events:
                result = results[index]
                result.token_ids.extend(out.new_token_ids)
                result.text_parts.append(out.new_text)
                result.logprobs.extend(out.new_logprobs or [])
                result.num_prompt_tokens = out.num_prompt_tokens or len(self.prepared.prompts[index // self.n])
                if out.finished:
                    result.finish_reason = out.finish_reason
                    result.error = out.error
                    result.error_param = out.error_param
                    result.error_code = out.error_code
        return results

    async def _choices(self, prompt: int) -> AsyncIterator[tuple[int, RequestOutput]]:
        """One engine request for prompt ``prompt``: its n choices, as (choice index, output)."""
        engine, prepared = self.ctx.engine, self.prepared
        engine_id = prepared.engine_request_id(prompt)
        stream = engine.generate(engine_id, prepared.prompts[prompt], prepared.params, prepared.kv_transfer_params)
        outputs = _refusals_as_400(stream)
        finished = refused = False
        num_finished = 0
        try:
            async for out in outputs:
                index = prompt * self.n + out.index
                num_finished += out.finished
                finished = num_finished == self.n or out.finish_reason == "error"
                self._observe(index, out)
                if out.finish_reason == "error" and prepared.kv_params is not None:
                    refusal = prepared.kv_params.refusal(out.error)  # the prefill node refused this pull
                    if refusal is not None:
                        raise refusal
                yield index, out
                if finished:
                    return
        except OpenAIError:
            refused = True  # never admitted: aborting would hit another request with this id
            raise
        finally:
            await outputs.aclose()
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
            if not finished and not refused:
                await engine.abort(engine_id)
                self.ctx.metrics.observe_error("aborted")

    async def _merged(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Several choices run concurrently; their outputs interleave as they come."""
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(prompt: int) -> None:
            try:
                async with aclosing(self._choices(prompt)) as outputs:
                    async for index, out in outputs:
                        queue.put_nowait((index, out))
                queue.put_nowait((prompt, None))
            except Exception as exc:  # re-raised in the consumer, which owns error handling
                queue.put_nowait((index, exc))

        tasks = [asyncio.create_task(pump(i)) for i in range(len(self.prepared.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                index, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield index, item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _observe(self, index: int, out: RequestOutput) -> None:
        metrics, timing, now = self.ctx.metrics, self._timings[index], time.monotonic()
        if out.num_cached_tokens:
            self._cached_tokens[index // self.n] = out.num_cached_tokens
        num_new = len(out.new_token_ids)
        if num_new:
            if timing.first_token_at is None:
                timing.first_token_at = now
                metrics.observe_first_token(now - self.prepared.arrival_time)
                num_gaps = num_new - 1
            else:
                num_gaps = num_new
            if num_gaps and timing.last_token_at is not None:
                for _ in range(num_gaps):
                    metrics.observe_inter_token((now - timing.last_token_at) / num_gaps)
            timing.last_token_at = now
            metrics.observe_generated(num_new)
            self.num_output_tokens += num_new
        if out.finished:
            elapsed = now - self.prepared.arrival_time
            num_prompt = out.num_prompt_tokens or len(self.prepared.prompts[index // self.n])
            if out.finish_reason == "error":
                if out.error_param is None:  # the request's own fault is counted where it is answered
                    metrics.observe_error("engine")
                logger.warning("request %s failed after %.1f ms: %s", out.request_id, elapsed * 1e3, out.error)
                return
            metrics.observe_finished(out.finish_reason or "stop", num_prompt, elapsed)
            ttft = (timing.first_token_at or now) - self.prepared.arrival_time
            logger.info("request %s finished (%s): %d prompt + %d output tokens, first token %.1f ms, total %.1f ms",
                        out.request_id, out.finish_reason, num_prompt, out.num_output_tokens, ttft * 1e3, elapsed * 1e3)


async def _refusals_as_400(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """The engine refuses a request (duplicate id, prompt too long) with ValueError on its
    first step; that is the client's request, not a server fault."""
    iterator = aiter(stream)
    try:
        first = await anext(iterator)
    except StopAsyncIteration:
        return
    except ValueError as exc:
        raise OpenAIError(f"the engine refused the request: {exc}", code="invalid_request") from exc
    yield first
    async for out in iterator:
        yield out
