"""The client's body: parsed and checked once, re-encoded for the legs; a large one off the event
loop, so /health and other requests go on while it is parsed."""

from __future__ import annotations

import asyncio
import json

from common.serving.errors import invalid_json
from proxy.errors import BadRequest

OFF_LOOP_BYTES = 256 * 1024  # bodies larger than this are parsed and re-encoded in a worker thread


async def off_loop(size: int, fn, *args):
    """``fn(*args)``; in a worker thread for a large body, so /health and other requests go on."""
    if size <= OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


def is_text(value: object) -> bool:
    if not isinstance(value, str):
        return False
    try:
        value.encode()
    except UnicodeEncodeError:  # a lone surrogate: no node serves such a name
        return False
    return True


def encode_body(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


def with_field(raw: bytes, name: str, value: object) -> bytes:
    """``raw`` (a JSON object without ``name``) with ``name: value`` added, spliced before its closing
    brace: no parse and re-encode of a large prompt for one small field."""
    end = raw.rstrip()
    if not end.endswith(b"}"):  # JSON in UTF-16 or UTF-32 (json.loads reads them): parsed and encoded again
        return encode_body({**json.loads(raw), name: value})
    head = end[:-1].rstrip()
    comma = b"" if head.endswith(b"{") else b","
    return head + comma + json.dumps({name: value}, separators=(",", ":")).encode()[1:]


def parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except json.JSONDecodeError as exc:
        err = invalid_json(exc.pos)
        raise BadRequest(err.message, code=err.code) from exc
    except ValueError as exc:  # bytes that are not UTF-8
        err = invalid_json(None)
        raise BadRequest(err.message, code=err.code) from exc
    except RecursionError as exc:  # BodyLimits bounds the depth first; this is the last line
        raise BadRequest("request body nests JSON too deeply", code="nesting_too_deep") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", code="invalid_body")
    return body
