"""Send one request through a prefill and a decode daemon the way a proxy does."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from common.request_id import make_request_id


def post(url: str, path: str, body: dict, request_id: str | None = None, timeout: float = 60) -> httpx.Response:
    headers = {"X-Request-Id": request_id} if request_id else {}
    return httpx.post(url + path, json=body, headers=headers, timeout=timeout)


def read_stream(url: str, path: str, body: dict, request_id: str, timeout: float = 60) -> tuple[str, list[dict]]:
    """The text and every event of an SSE answer (must end with [DONE])."""
    events, text = [], ""
    with httpx.stream("POST", url + path, json=body, headers={"X-Request-Id": request_id}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return text, events
            event = json.loads(data)
            events.append(event)
            for choice in event.get("choices", []):
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
    raise AssertionError("stream ended without [DONE]")


def prefill_body(body: dict) -> dict:
    out = {k: v for k, v in body.items() if k != "stream_options"}
    return {**out, "max_tokens": 1, "stream": False}


def disaggregated(prefill, decode, path: str, body: dict, order: str = "concurrent") -> tuple[str, int]:
    """(text, completion_tokens) of ``body`` served by ``prefill`` -> ``decode``.

    ``order``: "prefill_first" (vLLM's proxy: wait for P, then D) or "concurrent".
    """
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)
    stream = bool(body.get("stream"))

    def decode_leg() -> tuple[str, int]:
        if stream:
            text, events = read_stream(decode.url, path, {**body, "stream_options": {"include_usage": True}}, rid)
            usage = [e["usage"] for e in events if e.get("usage")]
            return text, usage[-1]["completion_tokens"]
        r = post(decode.url, path, body, rid)
        assert r.status_code == 200, r.text
        data = r.json()
        choice = data["choices"][0]
        return choice.get("text") or choice["message"]["content"], data["usage"]["completion_tokens"]

    if order == "prefill_first":
        p = post(prefill.url, path, prefill_body(body), rid)
        assert p.status_code == 200, p.text
        return decode_leg()
    with ThreadPoolExecutor(2) as pool:
        p_future = pool.submit(post, prefill.url, path, prefill_body(body), rid)
        result = decode_leg()
        p = p_future.result()
    assert p.status_code == 200, p.text
    return result
