"""What every route shares: the engine, tokenizer and config, and the turn of an OpenAI
request into a :class:`PreparedRequest` the engine can run.

Preparation order: request id (the ``X-Request-Id`` header exactly as received, else
``cmpl-<uuid hex>``) -> model name -> prompt token ids -> role and request-id tags (or, for an
untagged id, the ``kv_transfer_params`` path's transfer id and tags: common.serving.kv_params) -> the
role's ``prepare_request`` hook (the seam where the prefill / decode daemons adjust a
request) -> sampling-param ranges -> length and vocabulary checks. Each check raises an
:class:`OpenAIError` that becomes a 400.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import Request

from common.cluster_auth import ClusterKey
from common.config import NodeConfig
from common.engine.protocol import EngineClient
from common.engine.sampling_params import SamplingParams, SamplingParamsError
from common.engine.structured_output import Grammar
from common.logging_setup import current_request_id
from common.metrics import NodeMetrics
from common.request_id import Tags, parse_tags
from common.serving.client_id import client_id
from common.serving.errors import REQUEST_ID_HEADER, OpenAIError, client_visible_id, model_not_served
from common.serving.kv_params import KVParamsProtocol, KVParamsRequest
from common.serving.limits import MAX_REQUEST_ID_CHARS
from common.serving.protocol import SamplingRequest
from common.serving.resume import resumed_prompts, wants_token_ids
from common.serving.response_format import ResponseFormats
from common.serving.unhonoured import check_unhonoured

logger = logging.getLogger(__name__)

TAG_FORMAT = "___prefill_addr_HOST:PORT___decode_addr_HOST:PORT_<uuid hex>"
OFF_LOOP_CHARS = 16_384  # prompts longer than this are tokenized in a worker thread
DECODES_PER_TOKEN = 16  # a logprobs entry's decode costs about as much as tokenizing this many chars
DEFAULT_MAX_TOKEN_CHARS = 64  # when the tokenizer cannot list its vocabulary
_T = TypeVar("_T")


@dataclass
class PreparedRequest:
    """One validated request: a token-id prompt per choice and the engine settings."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    tags: Tags | None
    kv_transfer_params: dict[str, Any] | None
    arrival_time: float = field(default_factory=time.monotonic)
    # set by a role's hook: runs once the request passed every check (e.g. the prefill node's
    # KV admission, which must not count a request that is about to be refused)
    admit: Callable[[], None] | None = None
    stream_token_ids: bool = False  # a pdserve proxy asked for the ids behind each event (resume.py)
    kv_params: KVParamsRequest | None = None  # on the kv_transfer_params path (kv_params.py)

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
    max_token_chars: int = field(init=False)
    response_formats: ResponseFormats = field(init=False)
    kv_params: KVParamsProtocol = field(init=False)
    # the peer tier: may this node fetch prefix blocks from the KV address a proxy's hint names?
    # (a daemon with --kv-peer-fetch on: an address the registry vouched for); hints ignored: counted
    peer_vouched: Callable[[str], bool] = lambda kv_addr: False
    peer_hints_ignored: int = 0

    def __post_init__(self) -> None:
        self._peer_hint_logged = -1e18
        self.max_token_chars = _longest_token_chars(self.tokenizer, self.vocab_size)
        self.response_formats = ResponseFormats(self.tokenizer, self.vocab_size)
        cfg, daemon = self.config, self.config.role in ("prefill", "decode")
        self.kv_params = KVParamsProtocol(
            cfg.role, cfg.kv_addr, ClusterKey.optional(cfg.cluster_key_file) if daemon else None,
            getattr(self.engine, "kv_layout", None) if daemon else None, cfg.kv_lease_s, cfg.kv_rank_count)

    def _peer_hint(self, body: SamplingRequest, params: SamplingParams) -> None:
        """The proxy's ``pdserve_peer_prefix`` into ``params.kv_peer`` when its peer is vouched for;
        else it is ignored (a hint: the node computes the prefix), and logged once a minute."""
        hint = body.pdserve_peer_prefix
        if hint is None:
            return
        if self.peer_vouched(hint.kv_addr):
            params.kv_peer = (hint.kv_addr, hint.blocks)
            return
        self.peer_hints_ignored += 1
        now = time.monotonic()
        if now - self._peer_hint_logged >= 60.0:
            self._peer_hint_logged = now
            logger.warning("ignored a peer-prefix hint naming %s: not a peer the registry vouched for, or this "
                           "node runs --kv-peer-fetch off (more are not logged for a minute)", hint.kv_addr)

    def set_role(self, config: NodeConfig) -> None:
        """A daemon's role flip (common/node/role_flip.py): ``config`` names the new role, whose
        rules apply from the next request on."""
        self.config = config
        self.kv_params.role = config.role

    @property
    def max_prompt_chars(self) -> int:
        """No prompt longer than this can fit: every token covers at most ``max_token_chars``."""
        return self.engine.max_model_len * self.max_token_chars

    def check_prompt_chars(self, num_chars: int, param: str) -> None:
        """Refuse a text that cannot fit ``max_model_len`` before spending time tokenizing it."""
        if num_chars > self.max_prompt_chars:
            raise OpenAIError(
                f"this model's maximum context length is {self.engine.max_model_len} tokens; a {num_chars}-"
                f"character prompt cannot fit (at most {self.max_token_chars} characters per token)",
                param=param,
                code="context_length_exceeded",
            )

    async def off_loop(self, num_chars: int, fn: Callable[..., _T], *args: Any) -> _T:
        """``fn(*args)``, in a worker thread when the input is large, so /health and other
        requests are not starved while a big prompt is tokenized or checked."""
        if num_chars <= OFF_LOOP_CHARS:
            return fn(*args)
        return await asyncio.to_thread(fn, *args)

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

    async def prepare(self, body: SamplingRequest, prompts: list[list[int]],
                      request: Request, grammar: Grammar | None = None) -> PreparedRequest:
        """Validate what the route tokenized and apply the node role's rules; ``grammar`` (a tool
        call's) replaces the one ``response_format`` asks for."""
        params = body.sampling_params()
        if grammar is None:
            grammar = await self.response_formats.grammar(body.response_format)
        params.grammar = grammar
        params.client = client_id(request, body)
        self._peer_hint(body, params)
        request_id = request_id_of(request)
        tags = parse_tags(request_id)
        via_params = self.kv_params.request((body.model_extra or {}).get("kv_transfer_params"), tags, prompts,
                                          bool(getattr(body, "stream", False)))
        if via_params is not None:  # run under its transfer id, as if the proxy had tagged it
            request_id, tags = via_params.transfer_id, via_params.tags
        self._check_role(tags, len(prompts))
        prompts = resumed_prompts(body.pdserve_resume_token_ids, prompts, params, tags)
        kv_params = None
        if tags is not None:  # a local prefill asks no peer: the engine prefills it like any prompt
            prefill = "" if tags.local_prefill else tags.prefill_addr
            kv_params = {"prefill_addr": prefill, "decode_addr": tags.decode_addr}
        prepared = PreparedRequest(request_id, prompts, params, tags, kv_params)
        prepared.stream_token_ids = wants_token_ids(request.headers)
        prepared.kv_params = via_params
        if via_params is not None and self.config.role == "decode":
            # verified params: a refusal from here on drops the prefill node's KV, as for a tagged id
            request.state.pdserve_kv_release = (via_params.transfer_id, via_params.tags.prefill_addr)
            prepared.admit = lambda: _spend(via_params, request)
        if self.prepare_request is not None:  # before the range checks: a prefill leg bounds min_tokens
            result = self.prepare_request(prepared, request)
            if result is not None:
                await result
        try:
            params.validate(self.vocab_size)
        except SamplingParamsError as exc:
            param = exc.param
            if param == "max_tokens" and getattr(body, "max_completion_tokens", None) is not None:
                param = "max_completion_tokens"  # the field this client actually sent
            raise OpenAIError(str(exc), param=param, code="invalid_value") from exc
        await self.off_loop(sum(map(len, prompts)), self._check_prompts, prompts, params.max_tokens)
        if prepared.admit is not None:
            prepared.admit()
        return prepared

    def check_model(self, body: SamplingRequest) -> None:
        check_unhonoured(body.model_extra, chat=hasattr(body, "messages"))
        if body.model is not None and body.model != self.model_name:
            raise OpenAIError(
                model_not_served(body.model, [self.model_name]),
                status=404,
                param="model",
                code="model_not_found",
            )
        if not 1 <= body.n <= self.config.max_n:
            raise OpenAIError(f"n must be in [1, {self.config.max_n}] (this server's --max-n); got {body.n}",
                              param="n", code="invalid_value")
        best_of = getattr(body, "best_of", None)
        if best_of not in (None, body.n):  # no ranking of extra candidates: best_of == n is just n
            raise OpenAIError(f"best_of must equal n ({body.n}) if given; got {best_of}", param="best_of",
                              code="unsupported_value")

    def _check_prompts(self, prompts: list[list[int]], max_tokens: int) -> None:
        vocab = self.vocab_size
        limit = self.engine.max_model_len
        for tokens in prompts:
            if not tokens:
                raise OpenAIError("prompt is empty", param="prompt", code="empty_prompt")
            if vocab is not None and (min(tokens) < 0 or max(tokens) >= vocab):  # C loops, then find it
                bad = next(t for t in tokens if not 0 <= t < vocab)
                raise OpenAIError(f"token id {bad} is outside the vocabulary [0, {vocab})", param="prompt",
                                  code="invalid_value")
            if len(tokens) >= limit:  # no room for a token; not phrased by max_tokens (a prefill leg's is 1)
                raise OpenAIError(
                    f"this model's maximum context length is {limit} tokens; "
                    f"the prompt has {len(tokens)} tokens",
                    param="prompt",
                    code="context_length_exceeded",
                )
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
            raise OpenAIError(f"a {role} node serves one prompt per request", param="prompt",
                              code="unsupported_value")
        if role == "prefill" and tags.local_prefill:
            raise OpenAIError("this request is marked for a local prefill on its decode node; a prefill "
                              "node has nothing to do for it", param="X-Request-Id", code="local_prefill")


def _spend(via_params: KVParamsRequest, request: Request) -> None:
    """Decode: the params pass every check; refused as spent, they drop nobody's KV."""
    try:
        via_params.admit()
    except OpenAIError:
        request.state.pdserve_kv_release = None
        raise


def request_id_of(request: Request, prefix: str = "cmpl-") -> str:
    """The engine's (and the logs') id: ``X-Request-Id`` exactly as received (a proxy's tag or
    a client's own id), else a fresh ``<prefix><uuid hex>``, which is also the reply's ``id``."""
    request_id = getattr(request.state, "pdserve_request_id", None)
    if request_id is None:
        request_id = request.headers.get(REQUEST_ID_HEADER) or f"{prefix}{uuid.uuid4().hex}"
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise OpenAIError(f"X-Request-Id is longer than {MAX_REQUEST_ID_CHARS} characters",
                              param="X-Request-Id", code="invalid_value")
        request.state.pdserve_request_id = request_id
        current_request_id.set(request_id)  # log lines of this request carry it
    return request_id


def response_id(request_id: str, prefix: str) -> str:
    """The ``id`` a client sees (``cmpl-``/``chatcmpl-`` + a base, as vLLM builds it).

    The base of a proxy's tagged id is its uuid: the routing tag never reaches a client.
    """
    base = client_visible_id(request_id)
    return base if base.startswith(prefix) else prefix + base


def response_headers(request: Request, public_id: str) -> dict[str, str]:
    """Echo the client's own ``X-Request-Id``; without one, name the reply's ``id``."""
    return {REQUEST_ID_HEADER: request.headers.get(REQUEST_ID_HEADER) or public_id}


def _longest_token_chars(tokenizer: Any, vocab_size: int | None) -> int:
    """The most characters one token can stand for (its vocabulary string's length bounds it:
    byte-level and sentencepiece tokens spell at least one symbol per decoded character)."""
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if convert is None or not vocab_size:
        return DEFAULT_MAX_TOKEN_CHARS
    try:
        return max((len(t) for t in convert(list(range(vocab_size))) if t), default=1)
    except Exception:  # a tokenizer that cannot list every id: fall back to the generous bound
        return DEFAULT_MAX_TOKEN_CHARS


async def get_context(request: Request) -> ServingContext:
    """FastAPI dependency: the context ``build_app`` stored on the app. ``async`` on purpose:
    FastAPI runs a plain ``def`` dependency in its worker-thread pool, a thread hop per request
    that under load grew every daemon by AnyIO's 40 pool threads."""
    return request.app.state.serving
