"""A scripted EngineClient and a character-level tokenizer for serving-layer tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from common.engine.outputs import RequestOutput
from common.engine.protocol import EngineStats
from common.engine.sampling_params import SamplingParams

VOCAB_SIZE = 256


class ChatTemplateError(Exception):
    """Same name as the real tokenizer's error, which the chat route recognises."""


class CharTokenizer:
    """One token per byte; a trivial chat template that refuses a 'tool' message."""

    vocab_size = VOCAB_SIZE

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode())
        return ([1] if add_special_tokens else []) + ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i >= 32).decode(errors="replace")

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if any(m["role"] == "tool" for m in messages):
            raise ChatTemplateError("tool messages are not supported by this template")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class GenerateCall:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: dict | None


@dataclass
class FakeEngine:
    """Yields ``params.max_tokens`` tokens 'a', 'b', 'c'... one output each, finish 'length'.

    ``error`` makes every request fail after ``error_after`` tokens; ``delay_s`` paces tokens.
    """

    model_name: str = "fake-model"
    max_model_len: int = 64
    delay_s: float = 0.0
    error: str | None = None
    error_after: int = 1
    with_logprobs: bool = True
    calls: list[GenerateCall] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    running: set[str] = field(default_factory=set)
    on_output: Callable[[RequestOutput], None] | None = None

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        self.calls.append(GenerateCall(request_id, list(prompt_token_ids), params, kv_transfer_params))
        if request_id in self.running:  # as AsyncLLMEngine does
            raise ValueError(f"request id {request_id!r} is already running")
        self.running.add(request_id)
        try:
            for i in range(params.max_tokens):
                if self.delay_s:
                    await asyncio.sleep(self.delay_s)
                token = ord("a") + i % 26
                if self.error is not None and i >= self.error_after:
                    yield RequestOutput(request_id, [], finished=True, finish_reason="error", error=self.error)
                    return
                last = i == params.max_tokens - 1
                for index in range(params.n):  # choices interleave, as the engine's do
                    yield RequestOutput(
                        request_id,
                        [token],
                        new_text=chr(token),
                        finished=last,
                        finish_reason="length" if last else None,
                        num_prompt_tokens=len(prompt_token_ids),
                        num_output_tokens=i + 1,
                        new_logprobs=[{token: -0.5, token + 1: -1.5}] if params.logprobs is not None else None,
                        index=index,
                    )
        finally:
            self.running.discard(request_id)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.running.discard(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_waiting=0, num_free_blocks=8, num_total_blocks=8)
