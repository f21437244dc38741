"""OpenAI request bodies (the subset pdserve serves), validated strictly.

Strict mode makes ``"max_tokens": "5"`` or ``"prompt": [true]`` a 400 instead of a silent
coercion. Undeclared fields are kept (``model_extra``) and checked by ``unhonoured.py``:
the OpenAI / vLLM ones this server does not implement (``tools``, ``length_penalty``...) are a
400 unless sent at a value that asks for nothing; ``user`` and a few others are ignored on
purpose; names nobody defines are ignored. Integers are bounded here (a 2^70 seed would overflow
the sampler's int64) and every text must be encodable (a lone surrogate ``"\ud800"``
is valid JSON but no tokenizer can read it), so both are 400s naming the field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from common.engine.sampling_params import MAX_CACHE_SALT_CHARS, SamplingParams

INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1


def _encodable(value: Any) -> Any:
    """Strings (also inside lists) must be valid Unicode: no unpaired surrogates."""
    for text in [value] if isinstance(value, str) else value if isinstance(value, list) else []:
        if isinstance(text, str):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"contains invalid Unicode (an unpaired surrogate at {exc.start})") from None
    return value


Text = Annotated[str, AfterValidator(_encodable)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=-INT32_MAX, le=INT32_MAX)]  # semantic ranges: SamplingParams.validate
Prompt = Text | list[Text] | list[TokenId] | list[list[TokenId]]
# logit_bias keys are token ids written as JSON strings (OpenAI's shape); ranges: SamplingParams.validate
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage on every chunk (with include_usage)


class PeerPrefix(BaseModel):
    """The proxy's hint for the peer tier: the KV endpoint of another daemon that holds the prompt's
    first ``blocks`` blocks in its pool (common/engine/kv_tiers.py)."""

    model_config = ConfigDict(strict=True, extra="forbid")
    kv_addr: Annotated[str, Field(max_length=262, pattern=r"^[A-Za-z0-9._\-\[\]:%]{1,253}:[0-9]{1,5}$")]
    blocks: Annotated[int, Field(ge=1, le=1 << 20)]


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # BaseModel.schema exists
    strict: bool | None = None  # the schema is always enforced, strict or not


class ResponseFormat(BaseModel):
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``"""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(BaseModel):
    """Fields shared by completions and chat completions."""

    model_config = ConfigDict(strict=True, extra="allow")  # extras: unhonoured.check_unhonoured

    model: Text | None = None
    max_tokens: Count | None = None
    min_tokens: Count = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Count = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[TokenIdKey, float] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=INT64_MAX)] | None = None
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list)
    ignore_eos: bool = False
    n: Count = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None
    response_format: ResponseFormat | None = None  # compiled by common.serving.response_format
    # vLLM's: only requests with the same salt share prefix-cache blocks (tenant isolation)
    cache_salt: Annotated[Text, Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS)] | None = None
    # internal: a pdserve proxy resuming a request elsewhere sends the ids already streamed (resume.py)
    pdserve_resume_token_ids: list[TokenId] | None = None
    # internal: a pdserve proxy's hint that a peer holds the prompt's prefix (--kv-peer-fetch)
    pdserve_peer_prefix: PeerPrefix | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage on every chunk: vLLM asks for ``include_usage`` and ``continuous_usage_stats``."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

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
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            logit_bias={int(token): bias for token, bias in (self.logit_bias or {}).items()},
            seed=self.seed,
            max_tokens=self.requested_max_tokens(),
            min_tokens=self.min_tokens,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids),
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            cache_salt=self.cache_salt,
            n=self.n,
        )


class CompletionRequest(SamplingRequest):
    """POST /v1/completions."""

    prompt: Prompt
    logprobs: Count | None = None
    echo: bool = False
    best_of: Count | None = None  # only None or n (ServingContext.check_model)

    def requested_logprobs(self) -> int | None:
        return self.logprobs


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def num_chars(self) -> int:
        if isinstance(self.content, list):
            return sum(len(part.text) for part in self.content)
        return len(self.content or "")

    def as_template_input(self) -> dict[str, Any]:
        """The plain ``{"role", "content"}`` dict a chat template expects (text parts joined)."""
        if isinstance(self.content, list):
            content = "".join(part.text for part in self.content)
        else:
            content = self.content or ""
        return {"role": self.role, "content": content}


MAX_TOOLS = 128  # OpenAI's limit
FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # OpenAI's rule: safe inside JSON


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object; None: no arguments
    strict: bool | None = None  # the schema is always enforced, strict or not


class Tool(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: FunctionName


class NamedToolChoice(BaseModel):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this function."""

    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["function"]
    function: ToolChoiceFunction


class ChatCompletionRequest(SamplingRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_completion_tokens: Count | None = None
    logprobs: bool = False
    top_logprobs: Count | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None  # served by common.serving.tools
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None

    def requested_max_tokens(self) -> int:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return super().requested_max_tokens()

    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None
