"""What every route shares: the engine, tokenizer and config, and the turn of an OpenAI
request into a :class:`PreparedRequest` the engine can run.

Preparation order: request id (the ``X-Request-Id`` header exactly as received, else
``cmpl-<uuid hex>``) -> model name -> sampling params -> prompt token ids -> length and
vocabulary checks -> role and request-id tags -> the role's ``prepare_request`` hook
(the seam where the prefill / decode daemons adjust a request). Each check raises an
:class:`OpenAIError` that becomes a 400.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from common.config import NodeConfig
from common.engine.protocol import EngineClient
from common.engine.sampling_params import SamplingParams, SamplingParamsError
from common.logging_setup import current_request_id
from common.metrics import NodeMetrics
from common.request_id import Tags, parse_tags
from common.serving.errors import REQUEST_ID_HEADER, OpenAIError
from common.serving.protocol import SamplingRequest

TAG_FORMAT = "___prefill_addr_HOST:PORT___decode_addr_HOST:PORT_<uuid hex>"


@dataclass
class PreparedRequest:
    """One validated request: a token-id prompt per choice and the engine settings."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    tags: Tags | None
    kv_transfer_params: dict[str, Any] | None
    arrival_time: float = field(default_factory=time.monotonic)

    def engine_request_id(self, index: int) -> str:
        # One prompt keeps the id exactly (P and D key transfers by it); only a batch of
        # prompts, which is refused on prefill/decode nodes, needs one id per choice.
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{index}"


PrepareHook = Callable[[PreparedRequest, Request], Awaitable[None] | None]


@dataclass
class ServingContext:
    engine: EngineClient
    tokenizer: Any
    config: NodeConfig
    metrics: NodeMetrics
    ready: Callable[[], bool]
    prepare_request: PrepareHook | None = None

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def vocab_size(self) -> int | None:
        for owner in (self.engine, self.tokenizer):
            size = getattr(owner, "vocab_size", None)
            if isinstance(size, int):
                return size
        return None

    async def prepare(self, body: SamplingRequest, prompts: list[list[int]], request: Request) -> PreparedRequest:
        """Validate what the route tokenized and apply the node role's rules."""
        params = body.sampling_params()
        try:
            params.validate()
        except SamplingParamsError as exc:
            raise OpenAIError(str(exc), param=exc.param) from exc
        self._check_prompts(prompts, params.max_tokens)
        request_id = request_id_of(request)
        tags = parse_tags(request_id)
        self._check_role(tags, len(prompts))
        kv_params = {"prefill_addr": tags.prefill_addr, "decode_addr": tags.decode_addr} if tags else None
        prepared = PreparedRequest(request_id, prompts, params, tags, kv_params)
        if self.prepare_request is not None:
            result = self.prepare_request(prepared, request)
            if result is not None:
                await result
        return prepared

    def check_model(self, body: SamplingRequest) -> None:
        if body.model is not None and body.model != self.model_name:
            raise OpenAIError(
                f"model '{body.model}' is not served here; this node serves '{self.model_name}'",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        if body.n != 1:
            raise OpenAIError(f"n={body.n} is not supported; only n=1", param="n")

    def _check_prompts(self, prompts: list[list[int]], max_tokens: int) -> None:
        vocab = self.vocab_size
        limit = self.engine.max_model_len
        for tokens in prompts:
            if not tokens:
                raise OpenAIError("prompt is empty", param="prompt")
            if vocab is not None:
                bad = next((t for t in tokens if not 0 <= t < vocab), None)
                if bad is not None:
                    raise OpenAIError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt")
            if len(tokens) + max_tokens > limit:
                raise OpenAIError(
                    f"this model's maximum context length is {limit} tokens; the request has "
                    f"{len(tokens)} prompt tokens + {max_tokens} max_tokens = {len(tokens) + max_tokens}",
                    param="max_tokens",
                    code="context_length_exceeded",
                )

    def _check_role(self, tags: Tags | None, num_prompts: int) -> None:
        role = self.config.role
        if role == "both":
            return
        if tags is None:
            raise OpenAIError(
                f"this is a {role} node (role '{role}'): requests need a tagged X-Request-Id header "
                f"'{TAG_FORMAT}'; send them through the pdserve proxy or use a node with role 'both'",
                param="X-Request-Id",
                code="untagged_request",
            )
        if num_prompts != 1:
            raise OpenAIError(f"a {role} node serves one prompt per request", param="prompt")


def request_id_of(request: Request) -> str:
    """The client's ``X-Request-Id`` exactly as received, else a fresh ``cmpl-<uuid hex>``."""
    request_id = getattr(request.state, "pdserve_request_id", None)
    if request_id is None:
        request_id = request.headers.get(REQUEST_ID_HEADER) or f"cmpl-{uuid.uuid4().hex}"
        request.state.pdserve_request_id = request_id
        current_request_id.set(request_id)  # log lines of this request carry it
    return request_id


def get_context(request: Request) -> ServingContext:
    """FastAPI dependency: the context ``build_app`` stored on the app."""
    return request.app.state.serving
