"""The StreamLedger: what a client has of a stream, and how a resumed stream is stitched on."""

from __future__ import annotations

import json

import pytest

from proxy.errors import UpstreamError, UpstreamUnreachable
from proxy.migration import Migration, StreamError, StreamLedger


def _event(chunk: dict, ids: list[int] | None = None) -> bytes:
    note = f": pdserve-ids 0 {','.join(map(str, ids))}\n" if ids else ""
    return f"{note}data: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()


def _chat(uid: str, delta: dict, finish: str | None = None, usage: dict | None = None) -> dict:
    chunk = {"id": f"chatcmpl-{uid}", "object": "chat.completion.chunk", "created": 7 if uid == "a" else 9,
             "model": "m", "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        chunk["usage"] = usage
    return chunk


def test_notes_are_stripped_and_ids_counted_even_split_across_reads() -> None:
    ledger = StreamLedger("d1")
    raw = (_event(_chat("a", {"role": "assistant", "content": ""}))
           + _event(_chat("a", {"content": "He"}), [5, 6]) + b": pdserve-ids 0 7\n\n"
           + _event(_chat("a", {"content": "llo"}), [8]))
    out = b"".join(ledger.feed(raw[i:i + 7]) for i in range(0, len(raw), 7))
    assert b"pdserve-ids" not in out
    assert out == (_event(_chat("a", {"role": "assistant", "content": ""})) + _event(_chat("a", {"content": "He"}))
                   + _event(_chat("a", {"content": "llo"})))
    assert ledger.token_ids == [5, 6, 7, 8] and ledger.resumable


def test_an_event_cut_short_counts_neither_its_text_nor_its_ids() -> None:
    ledger = StreamLedger("d1")
    whole = _event(_chat("a", {"content": "x"}), [1])
    cut = _event(_chat("a", {"content": "y"}), [2])[:-5]
    assert ledger.feed(whole + cut) == _event(_chat("a", {"content": "x"}))
    assert ledger.token_ids == [1]


def test_a_resumed_stream_keeps_id_and_created_drops_the_role_chunk_and_counts_usage_whole() -> None:
    ledger = StreamLedger("d1")
    ledger.feed(_event(_chat("a", {"role": "assistant", "content": ""})) + _event(_chat("a", {"content": "A"}), [1, 2]))
    ledger.resume("d2")
    out = ledger.feed(_event(_chat("b", {"role": "assistant", "content": ""}))
                      + _event(_chat("b", {"content": "B"}), [3])
                      + _event(_chat("b", {}, "length"))
                      + _event({"id": "chatcmpl-b", "object": "chat.completion.chunk", "created": 9, "model": "m",
                                "choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 1,
                                                         "total_tokens": 13}})
                      + b"data: [DONE]\n\n")
    events = [json.loads(e[6:]) for e in out.split(b"\n\n") if e.startswith(b"data: {")]
    assert [e["id"] for e in events] == ["chatcmpl-a"] * 3 and {e["created"] for e in events} == {7}
    assert events[0]["choices"][0]["delta"] == {"content": "B"}
    assert events[2]["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert ledger.done and ledger.finished and ledger.token_ids == [1, 2, 3]


def test_content_without_notes_cannot_be_resumed() -> None:
    ledger = StreamLedger("vllm")
    ledger.feed(_event({"id": "cmpl-x", "choices": [{"index": 0, "text": "hi", "finish_reason": None}]}))
    assert not ledger.resumable



def test_several_choices_or_a_relayed_finish_are_not_resumed() -> None:
    """n > 1 (a note for choice 1) is not tracked; a stream whose finish_reason went out is whole
    but for its [DONE]: neither is resumed elsewhere."""
    many = StreamLedger("d1")
    many.feed(_event(_chat("a", {"content": "x"}), [5]) + b": pdserve-ids 1 6\n" + b"data: {}\n\n")
    assert not many.resumable
    finished = StreamLedger("d1")
    finished.feed(_event(_chat("a", {"content": "x"}), [5]))
    assert finished.resumable
    finished.feed(_event(_chat("a", {}, "stop")))
    assert not finished.resumable

def test_an_error_event_raises() -> None:
    ledger = StreamLedger("d1")
    with pytest.raises(StreamError):
        ledger.feed(b'data: {"error":{"message":"KV transfer failed"}}\n\n')


def test_resume_body_continues_the_budget() -> None:
    m = Migration("/v1/chat/completions", {"messages": [], "max_completion_tokens": 10, "min_tokens": 4}, 2)
    ledger = StreamLedger("d1", token_ids=[1, 2, 3])
    assert m.resume_body(ledger) == {"messages": [], "max_completion_tokens": 7, "min_tokens": 1,
                                     "pdserve_resume_token_ids": [1, 2, 3]}
    ledger.token_ids = list(range(10))
    assert m.resume_body(ledger) is None  # nothing left to generate


def test_causes_and_the_nodes_they_rule_out() -> None:
    m = Migration("/v1/completions", {}, 2)
    assert m.cause(UpstreamUnreachable("decode", "d1", "stream broke")) == "decode_lost"
    assert m.cause(UpstreamError("decode", "d2", 400, b"{}")) is None
    assert m.cause(StreamError("d3", b""), prefill="p1") == "decode_error"
    assert m.failed_decodes == {"d1"} and m.failed_prefills == {"p1"}


def test_an_error_event_that_blames_the_request_is_relayed_and_ends_the_stream() -> None:
    ledger = StreamLedger("d1")
    event = (b'data: {"error": {"message": "the response_format cannot be followed", "type": '
             b'"invalid_request_error", "param": "response_format", "code": "response_format_failed"}}\n\n')
    assert ledger.feed(event) == event  # relayed as the node wrote it: never resumed elsewhere
    assert not ledger.resumable


def test_whose_fault_decides_what_is_avoided() -> None:
    """A request's fault (4xx) never migrates, a prefill node's 4xx neither; a node's refusal that
    speaks of the node (409 stale role, 429 busy) does; a decode node whose KV never came blames its
    prefill node, not itself."""
    m = Migration("/v1/completions", {}, 2)
    assert m.cause(UpstreamError("prefill", "p1", 400, b"{}")) is None
    assert m.cause(UpstreamError("decode", "d1", 409, b"{}")) == "decode_error"
    kv_lost = b'{"error":{"message":"data plane failed","type":"server_error","param":null,"code":"kv_transfer_failed"}}'
    assert m.cause(UpstreamError("decode", "d2", 502, kv_lost), prefill="p2") == "prefill_failed"
    assert m.cause(StreamError("d3", b"data: " + kv_lost + b"\n\n"), prefill="p3") == "prefill_failed"
    assert m.failed_decodes == {"d1"} and m.failed_prefills == {"p2", "p3"}
