from __future__ import annotations

import threading
import time

import pytest
import zmq

from common.kv_transfer.config import TransferError
from common.kv_transfer.control import ControlPlane
from common.kv_transfer.messages import Ok, Ping, encode
from kvt_fixtures import no_thread_leak  # noqa: F401


def _server(got: list) -> ControlPlane:
    box: dict = {}

    def on_router(identity, msg):
        got.append(msg)
        box["cp"].reply(identity, Ok(id=msg.id))

    box["cp"] = ControlPlane("127.0.0.1:0", on_router, lambda a, m: None)
    return box["cp"]


def test_request_gets_matched_response(no_thread_leak):
    got: list = []
    server = _server(got)
    client = ControlPlane("127.0.0.1:0", lambda i, m: None, lambda a, m: None)
    try:
        replies = [client.request(server.address, Ping(), 2.0) for _ in range(5)]
        assert [type(f.result(3)) for f in replies] == [Ok] * 5
        assert sorted(r.result().id for r in replies) == sorted(m.id for m in got)
    finally:
        client.close()
        server.close()


def test_garbage_and_unknown_frames_are_dropped_listener_survives(no_thread_leak):
    got: list = []
    server = _server(got)
    client = ControlPlane("127.0.0.1:0", lambda i, m: None, lambda a, m: None)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        raw.connect(f"tcp://{server.address}")
        raw.send(b"\x00\xffnot msgpack")
        raw.send_multipart([b"a", b"b", b"c"])
        raw.send(encode(Ping()).replace(b"ping", b"pong"))  # unknown cmd
        time.sleep(0.2)
        assert got == []
        assert isinstance(client.request(server.address, Ping(), 2.0).result(3), Ok)
    finally:
        raw.close()
        ctx.term()
        client.close()
        server.close()


def test_request_to_silent_peer_fails_at_deadline(no_thread_leak):
    silent = ControlPlane("127.0.0.1:0", lambda i, m: None, lambda a, m: None)
    client = ControlPlane("127.0.0.1:0", lambda i, m: None, lambda a, m: None)
    try:
        t0 = time.monotonic()
        with pytest.raises(TransferError):
            client.request(silent.address, Ping(), 0.3).result(3)
        assert time.monotonic() - t0 < 1.0
    finally:
        client.close()
        silent.close()
    assert threading.active_count() >= 1
