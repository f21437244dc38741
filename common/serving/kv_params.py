"""``kv_transfer_params``: the prefill/decode protocol today's routers speak (vLLM's NIXL proxy,
vLLM Router, llm-d), on the same transfer as the tagged ids.

A request's life through it:

1. **prefill** — the router POSTs the prefill node the request with ``kv_transfer_params``
   ``{"do_remote_decode": true, ...}``, ``max_tokens`` 1, ``stream`` false and an ``X-Request-Id``
   that is not tagged (any id). The node does not know which decode node will pull, so it mints
   a *transfer id* in the tagged form with itself as prefill address and :data:`ANY_DECODE` as
   decode address, and runs the request under it exactly as a tagged prefill leg: the KV waits
   for a pull under the lease (``--kv-lease-s``, ``--max-unclaimed-kv-share``). Its reply carries
   a top-level ``kv_transfer_params`` naming it (``remote_host``/``remote_port``: its KV endpoint;
   ``transfer_id``; ``num_blocks``; ``kv_layout``: the layout fingerprint; ``first_token``;
   ``prompt_digest``; ``expires_at``: unix seconds), signed with the cluster key when there is one.
2. **decode** — the router POSTs the decode node the original request with those params and
   ``do_remote_prefill: true``. The node checks them (the signature under its key; the fields;
   its own layout fingerprint and TP size; the prompt it tokenized against the digest; the
   expiry; a transfer id used here before), then runs the request under the transfer id with the
   prefill address they name, exactly as if the proxy had tagged it: the pull, DONE's first
   token, override, fallback and release are the tagged path's.

A request whose ``X-Request-Id`` is tagged takes the tag path as before (the params are only
checked for shape), so a client cannot slip params past our proxy. Refusals are OpenAI errors
naming the field: 400 ``kv_transfer_params_invalid`` (shape, fields, prompt, layout),
``kv_transfer_params_unsupported`` (a role or TP size this cannot serve), 403
``kv_transfer_params_forged`` (the signature), 410 ``kv_expired`` (the lease is over, or the
prefill node says so at the pull), 409 ``kv_already_pulled``. A prefill node that is gone
fails the pull as on the tag path (502 ``kv_transfer_failed``, within ``--kv-timeout-s``). A
stream's reply on the decode node starts with its first token (``GenerationRun.start``), so a
refused pull is an HTTP error there too, not an event in a 200 stream.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
import uuid
from array import array
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from common.cluster_auth import ClusterKey, ReplayWindow
from common.request_id import ANY_DECODE, Tags, make_request_id, parse_tags
from common.serving.errors import OpenAIError
from common.serving.limits import MAX_REQUEST_ID_CHARS

PARAM = "kv_transfer_params"
_PURPOSE = b"pdserve-kv-transfer-params"
_SIGNED = ("transfer_id", "remote_host", "remote_port", "num_blocks", "kv_layout", "first_token", "kv_ranks",
           "prompt_digest", "expires_at")
_NEEDED = ("transfer_id", "remote_host", "remote_port", "num_blocks", "kv_layout", "prompt_digest", "expires_at")
MAX_EXTRA_FIELDS, MAX_EXTRA_CHARS = 16, 4096
USED_WINDOW_S = 3600.0  # a transfer id used here is refused again this long (leases are far shorter)
# the prefill node's words at a pull (common/kv_transfer: producer.py, producer_table.py)
EXPIRED_REASONS = ("lease expired",)
PULLED_REASONS = ("already pulled",)


class KVTransferParams(BaseModel):
    """The field's shape, checked once on every node: bounded sizes, exact types."""

    model_config = ConfigDict(extra="allow", strict=True)

    do_remote_decode: bool | None = None
    do_remote_prefill: bool | None = None
    remote_engine_id: str | None = Field(None, max_length=256)
    remote_block_ids: list[int] | None = Field(None, max_length=1 << 16)
    remote_host: str | None = Field(None, min_length=1, max_length=255)
    remote_port: int | None = Field(None, ge=1, le=65535)
    tp_size: int | None = Field(None, ge=1, le=1024)
    transfer_id: str | None = Field(None, min_length=1, max_length=MAX_REQUEST_ID_CHARS)
    num_blocks: int | None = Field(None, ge=1, le=1 << 24)
    kv_layout: str | None = Field(None, max_length=64)
    first_token: int | None = Field(None, ge=0, le=1 << 31)
    kv_ranks: int | None = Field(None, ge=1, le=1024)
    prompt_digest: str | None = Field(None, max_length=64)
    expires_at: int | None = Field(None, ge=0, le=1 << 40)
    signature: str | None = Field(None, max_length=256)

    @model_validator(mode="after")
    def _bounded_extra(self) -> KVTransferParams:
        extra = self.model_extra or {}
        if len(extra) > MAX_EXTRA_FIELDS or len(json.dumps(extra, default=str)) > MAX_EXTRA_CHARS:
            raise ValueError(f"at most {MAX_EXTRA_FIELDS} other fields of {MAX_EXTRA_CHARS} characters in all")
        return self


def parse_params(value: Any) -> KVTransferParams | None:
    """The body's ``kv_transfer_params`` (None when absent or null), or a 400 naming the field."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise _invalid("kv_transfer_params must be an object or null")
    try:
        return KVTransferParams.model_validate(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in (PARAM, *first.get("loc", ())))
        raise _invalid(f"'{where}': {first.get('msg', 'invalid value')}") from None


def prompt_digest(prompt: list[int]) -> str:
    return hashlib.sha256(array("q", prompt).tobytes()).hexdigest()[:32]


@dataclass
class KVParamsRequest:
    """One request on the ``kv_transfer_params`` path: the id and tags it runs under."""

    protocol: KVParamsProtocol
    transfer_id: str
    tags: Tags
    prompt: list[int]

    def admit(self) -> None:
        """Decode: the request passed every check; its transfer id is spent here from now on."""
        if not self.protocol.used.first_time(self.transfer_id.encode()):
            raise OpenAIError(f"{PARAM} already used on this node: its KV was pulled once (transfer ids are "
                              "single use); run the prefill again", status=409, param=PARAM, code="kv_already_pulled")

    def reply(self, first_token: int | None) -> dict[str, Any]:
        """Prefill: the reply's ``kv_transfer_params``, naming where the KV waits."""
        return self.protocol.reply_params(self.transfer_id, self.prompt, first_token)

    def refusal(self, error: str | None) -> OpenAIError | None:
        """Decode: a pull the prefill node refused, as the client's 4xx (None: a node's failure)."""
        text = (error or "").lower()
        if any(r in text for r in PULLED_REASONS):
            return OpenAIError(f"{PARAM} refused by the prefill node: {error} (transfer ids are single use)",
                               status=409, param=PARAM, code="kv_already_pulled")
        if any(r in text for r in EXPIRED_REASONS):
            return OpenAIError(f"{PARAM} expired: the prefill node no longer holds this KV ({error}); run the "
                               "prefill again", status=410, param=PARAM, code="kv_expired")
        return None


class KVParamsProtocol:
    """One node's side of the protocol: what its role does with the field, and the signatures."""

    def __init__(self, role: str, kv_addr: str, key: ClusterKey | None, kv_layout: Any, lease_s: float,
                 kv_ranks: int) -> None:
        self.role, self.kv_addr, self.key, self.lease_s, self.kv_ranks = role, kv_addr, key, lease_s, kv_ranks
        self.fingerprint = kv_layout.fingerprint() if kv_layout is not None else None
        self.block_size = kv_layout.block_size if kv_layout is not None else None
        self.used = ReplayWindow(USED_WINDOW_S)

    def request(self, value: Any, tags: Tags | None, prompts: list[list[int]],
                stream: bool = False) -> KVParamsRequest | None:
        """The request's path: None for the tag path (or no params), else the id and tags to run under."""
        params = parse_params(value)
        if params is None or tags is not None:  # a tagged id keeps the tag path exactly
            return None
        if not (params.do_remote_decode or params.do_remote_prefill):
            return None
        flag = {"prefill": "do_remote_decode", "decode": "do_remote_prefill"}.get(self.role)
        if flag is None or self.fingerprint is None:
            raise OpenAIError(f"this node (role {self.role}) transfers no KV: send {PARAM} to a prefill or "
                              "decode daemon", param=PARAM, code="kv_transfer_params_unsupported")
        if not getattr(params, flag):
            raise OpenAIError(f"this is a {self.role} node: it serves {PARAM} with {flag}: true",
                              param=PARAM, code="kv_transfer_params_unsupported")
        if len(prompts) != 1:
            raise OpenAIError(f"a request with {PARAM} has one prompt", param="prompt", code="unsupported_value")
        if self.role == "prefill" and stream:
            raise OpenAIError(f"a prefill request with {PARAM} answers once, with the params: send stream false",
                              param="stream", code="unsupported_value")
        if self.role == "prefill":
            transfer_id = make_request_id(self.kv_addr, ANY_DECODE, uuid.uuid4().hex)
        else:
            transfer_id = self._check(params, prompts[0])
        tags = parse_tags(transfer_id)
        assert tags is not None
        if self.role == "decode":
            tags = Tags(prefill_addr=f"{params.remote_host}:{params.remote_port}", decode_addr=self.kv_addr)
        return KVParamsRequest(self, transfer_id, tags, prompts[0])

    def reply_params(self, transfer_id: str, prompt: list[int], first_token: int | None) -> dict[str, Any]:
        host, _, port = self.kv_addr.rpartition(":")
        assert self.block_size is not None
        signed = {"transfer_id": transfer_id, "remote_host": host, "remote_port": int(port),
                  "num_blocks": -(-len(prompt) // self.block_size), "kv_layout": self.fingerprint,
                  "first_token": first_token, "kv_ranks": self.kv_ranks, "prompt_digest": prompt_digest(prompt),
                  "expires_at": int(time.time() + self.lease_s)}
        return {"do_remote_decode": False, "do_remote_prefill": True, "remote_engine_id": self.kv_addr,
                "remote_block_ids": None, "tp_size": self.kv_ranks, **signed, "signature": self._sign(signed)}

    # ---- decode -------------------------------------------------------------------------
    def _check(self, params: KVTransferParams, prompt: list[int]) -> str:
        """The transfer id of params a prefill node of this cluster made for this prompt, or the refusal."""
        missing = [name for name in _NEEDED if getattr(params, name) is None]
        if missing:
            raise _invalid(f"{PARAM} lacks {', '.join(missing)}: send the prefill node's reply's {PARAM} as it "
                           "came, with do_remote_prefill: true")
        signed = {name: getattr(params, name) for name in _SIGNED}
        if self.key is not None and not hmac.compare_digest(self._sign(signed) or "", params.signature or ""):
            raise OpenAIError(f"forbidden: {PARAM} not signed by a prefill node of this cluster (the signature "
                              "does not match its fields)", status=403, type="permission_error", param=PARAM,
                              code="kv_transfer_params_forged")
        assert params.transfer_id is not None
        tags = parse_tags(params.transfer_id)
        if tags is None or tags.decode_addr != ANY_DECODE or \
                tags.prefill_addr != f"{params.remote_host}:{params.remote_port}":
            raise _invalid(f"{PARAM}.transfer_id is not one a prefill node at remote_host:remote_port made")
        if params.kv_layout != self.fingerprint:
            raise _invalid(f"{PARAM}.kv_layout {params.kv_layout} is not this node's KV layout ({self.fingerprint}):"
                           " the prefill node serves another model, dtype or block size")
        if (params.kv_ranks or 1) != self.kv_ranks:
            raise OpenAIError(f"{PARAM}: the prefill node has {params.kv_ranks} KV ranks and this decode node "
                              f"{self.kv_ranks} tensor-parallel ranks; through {PARAM} they must be equal",
                              param=PARAM, code="kv_transfer_params_unsupported")
        if params.prompt_digest != prompt_digest(prompt):
            raise _invalid(f"the prompt is not the one the prefill node computed for these {PARAM} (send the "
                           "same messages or prompt to both)")
        assert params.expires_at is not None
        if params.expires_at < time.time():
            raise OpenAIError(f"{PARAM} expired at {params.expires_at} (unix time): the prefill node's lease on "
                              "this KV is over; run the prefill again", status=410, param=PARAM, code="kv_expired")
        return params.transfer_id

    def _sign(self, signed: dict[str, Any]) -> str | None:
        if self.key is None:
            return None
        payload = json.dumps(signed, sort_keys=True, separators=(",", ":")).encode()
        return "v1." + self.key.mac(_PURPOSE, payload).hex()


def _invalid(message: str) -> OpenAIError:
    return OpenAIError(message, param=PARAM, code="kv_transfer_params_invalid")
