"""Request migration: a stream whose decode node dies or stalls goes on from another node.

A streamed request's life here:
1. the decode leg asks for the token ids behind each event (``x-pdserve-token-ids``); the
   ``StreamLedger`` relays the node's events, strips those notes, and keeps the ids of every
   event the client got (an event and its note are one unit: no id counts before its text went
   out, no text goes out without its ids);
2. the leg fails after the stream began (the connection broke, the node was evicted or sent
   nothing for ``--stream-idle-timeout-s``, its prefill leg failed, or it sent an error event
   that blames the node; one that blames the request, ``invalid_request_error``, is relayed):
   ``Migration.cause`` names why, and while ``--migration-limit`` allows, the dispatcher picks
   another pair (without the node that failed) and sends ``resume_body``: the client's body with
   the ids already streamed (``pdserve_resume_token_ids``) and the token budget that is left;
3. the ledger stitches the new stream into the old one: the first attempt's ``id`` and
   ``created``, no second chat role chunk, usage counted over the whole answer.
Greedy and seeded requests get the same tokens as an uninterrupted run (the seeded sampler is
keyed on seed and position); a node that never sends the notes (not pdserve) is not resumed once
it has sent content, since what the client has could not be known.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from common.engine.outputs import KV_TRANSFER_FAILED
from common.serving.resume import RESUME_FIELD, TOKEN_IDS_NOTE
from proxy.errors import (ProxyError, StreamIdle, UpstreamError, UpstreamStalled, UpstreamTimeout,
                          UpstreamUnreachable, node_code)

_NOTE = TOKEN_IDS_NOTE.encode()
_MAX_PARTIAL = 1 << 20  # an event larger than this without its end is relayed as it is
# 4xx statuses that speak of the node, not the request: another node may well serve it
_NODE_REFUSALS = frozenset({408, 409, 429})  # timed out reading, a stale role or epoch, too busy


class StreamError(ProxyError):
    """The decode node put an error event in its stream (e.g. its KV transfer failed)."""

    status, code, kind = 502, "upstream_error", "upstream_stream_error"

    def __init__(self, node: str, event: bytes):
        super().__init__(f"decode node {node} failed mid-stream: {event[:300].decode('utf-8', 'replace')}")
        self.role, self.node, self.event = "decode", node, event


@dataclass
class StreamLedger:
    """What the client has received of one streamed answer, across attempts."""

    node: str  # the decode node answering now
    token_ids: list[int] = field(default_factory=list)  # generated ids whose text the client has
    finished: bool = False  # a finish_reason went out
    done: bool = False  # [DONE] went out
    untracked: bool = False  # content went out without ids (a node that does not send the notes)
    resumed: int = 0  # ids the current attempt got in its prompt (0: the first attempt)
    _partial: bytes = b""
    _noted: bool = False  # the node sends the id notes (a pdserve node asked for them)
    _identity: dict | None = None  # the first attempt's id and created, imposed on later ones

    def feed(self, raw: bytes) -> bytes:
        """The bytes to relay for ``raw``: whole events only, notes stripped, later attempts stitched.
        Raises StreamError when the node sent an error event (the caller may resume instead)."""
        *events, self._partial = (self._partial + raw).split(b"\n\n")
        out = [self._event(e) for e in events]
        if len(self._partial) > _MAX_PARTIAL:  # not SSE as we know it: pass it through
            out.append(self._partial)
            self._partial, self.untracked = b"", True
        return b"".join(out)

    def resume(self, node: str) -> None:
        """A new attempt on ``node`` begins; its prompt carries every id so far."""
        self.node, self.resumed, self._partial = node, len(self.token_ids), b""

    @property
    def resumable(self) -> bool:
        return not (self.finished or self.done or self.untracked)

    def _event(self, event: bytes) -> bytes:
        ids: list[int] = []
        if event.startswith(_NOTE):
            note, _, event = event.partition(b"\n")
            ids = _note_ids(note)
            if ids is None:  # another choice's ids: n > 1 is not resumed
                self.untracked, ids = True, []
        self._noted = self._noted or bool(ids)
        if not event:  # ids whose text is still held back (a partial character, a possible stop string)
            self.token_ids += ids
            return b""
        payload = event[5:].strip() if event.startswith(b"data:") else None
        if payload == b"[DONE]":
            self.done = True
        elif payload is not None and payload.startswith(b'{"error"'):
            if not _request_fault(payload):
                raise StreamError(self.node, event + b"\n\n")
            self.finished = True  # the request's own fault: relayed as it is, never resumed elsewhere
        elif payload is not None:
            event = self._data(payload, event, ids)
        self.token_ids += ids
        return event + b"\n\n" if event else b""

    def _data(self, payload: bytes, event: bytes, ids: list[int]) -> bytes:
        if b'"finish_reason":"' in payload:
            self.finished = True
        if not self.resumed and self._identity is not None and (ids or self._noted):
            return event  # the common case: relayed without parsing
        try:
            chunk = json.loads(payload)
        except ValueError:
            self.untracked = True
            return event
        if not isinstance(chunk, dict):
            self.untracked = True
            return event
        if self._identity is None:
            self._identity = {k: chunk.get(k) for k in ("id", "created")}
        if self.resumed:
            return self._stitched(chunk)
        if not ids and _has_text(chunk):
            self.untracked = True
        return event

    def _stitched(self, chunk: dict) -> bytes:
        """A later attempt's chunk as the first attempt would have sent it."""
        choices = chunk.get("choices") or []
        if any(isinstance(c, dict) and isinstance(c.get("delta"), dict) and "role" in c["delta"] for c in choices):
            return b""  # the client had its role chunk from the first attempt
        chunk.update(self._identity or {})
        usage = chunk.get("usage")
        if isinstance(usage, dict) and "prompt_tokens" in usage:
            usage["prompt_tokens"] -= self.resumed
            usage["completion_tokens"] = usage.get("completion_tokens", 0) + self.resumed
            details = usage.get("prompt_tokens_details")
            if isinstance(details, dict) and isinstance(details.get("cached_tokens"), int):
                details["cached_tokens"] = min(details["cached_tokens"], usage["prompt_tokens"])
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode()


@dataclass
class Migration:
    """One request's migrations: what to resend, how many are left, which nodes to avoid."""

    path: str
    body: dict
    limit: int
    count: int = 0
    failed_decodes: set[str] = field(default_factory=set)
    failed_prefills: set[str] = field(default_factory=set)

    def cause(self, exc: BaseException, prefill: str | None = None) -> str | None:
        """Why an attempt may go on elsewhere (the metric's label), or None when it may not;
        ``prefill``: the attempt's prefill node (None for a local prefill). The failed node is avoided."""
        role = getattr(exc, "role", None)
        node = getattr(exc, "node", None) or ""
        if isinstance(exc, UpstreamError) and exc.status < 500 and exc.status not in _NODE_REFUSALS:
            return None  # the node refused the request itself (4xx): another would too
        if role == "prefill" and isinstance(exc, ProxyError):
            self.failed_prefills.add(node)
            return "prefill_failed"
        if isinstance(exc, StreamError):  # most often its KV transfer failed: the prefill end is suspect
            if prefill is not None:
                self.failed_prefills.add(prefill)
            if node_code(exc) == KV_TRANSFER_FAILED:  # it says so: the decode node may serve the next try
                return "prefill_failed"
            return "decode_error"
        if role != "decode":
            return None
        if node_code(exc) == KV_TRANSFER_FAILED and isinstance(exc, UpstreamError):  # the prefill end failed
            if prefill is not None:
                self.failed_prefills.add(prefill)
            return "prefill_failed"
        if isinstance(exc, (StreamIdle, UpstreamStalled, UpstreamTimeout)):
            cause = "decode_stalled"
        elif isinstance(exc, UpstreamUnreachable):
            cause = "decode_lost"
        elif isinstance(exc, UpstreamError) and (exc.status >= 500 or exc.status in _NODE_REFUSALS):
            cause = "decode_error"
        else:
            return None  # the node refused the request itself (4xx): another would too
        self.failed_decodes.add(node)
        return cause

    def resume_body(self, ledger: StreamLedger) -> dict | None:
        """The client's body, continued after what it has; None when nothing is left to generate."""
        body = dict(self.body)
        done = len(ledger.token_ids)
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int):
                body[key] -= done
                if body[key] < 1:
                    return None
        if not any(isinstance(body.get(k), int) for k in ("max_tokens", "max_completion_tokens")):
            if done >= 16:  # the OpenAI default max_tokens the nodes apply
                return None
            body["max_tokens"] = 16 - done
        if isinstance(body.get("min_tokens"), int):
            body["min_tokens"] = max(0, body["min_tokens"] - done)
        if done:
            body[RESUME_FIELD] = list(ledger.token_ids)
        return body


def _request_fault(payload: bytes) -> bool:
    """An error event that blames the request (OpenAI's ``invalid_request_error``, e.g. a
    response_format the grammar engine could not follow): no other node would do better."""
    try:
        error = json.loads(payload).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and error.get("type") == "invalid_request_error"


def _note_ids(note: bytes) -> list[int] | None:
    index, _, ids = note[len(_NOTE):].partition(b" ")
    if index != b"0":
        return None
    return [int(t) for t in ids.split(b",") if t]


def _has_text(chunk: dict) -> bool:
    choices = chunk.get("choices")
    for choice in choices if isinstance(choices, list) else []:
        delta = choice.get("delta") if isinstance(choice, dict) else None
        if isinstance(choice, dict) and choice.get("text"):
            return True
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
            return True
    return False
