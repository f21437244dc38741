"""OpenAI request bodies (the subset pdserve serves), validated strictly.

Strict mode makes ``"max_tokens": "5"`` or ``"prompt": [true]`` a 400 instead of a silent
coercion. Unknown fields (``user``, ``frequency_penalty``...) are accepted and ignored,
as clients send them routinely.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from common.engine.sampling_params import SamplingParams

Prompt = str | list[str] | list[int] | list[list[int]]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_max_tokens(self) -> int:
        return 16 if self.max_tokens is None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return None

    def sampling_params(self) -> SamplingParams:
        """Engine settings; range checks happen in ``SamplingParams.validate``."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            max_tokens=self.requested_max_tokens(),
            stop=stop,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
        )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: Prompt
    logprobs: int | None = None
    echo: bool = False

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_input(self) -> dict[str, Any]:
        """The plain ``{"role", "content"}`` dict a chat template expects (text parts joined)."""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        return {"role": self.role, "content": content}


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def requested_max_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().requested_max_tokens()

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
