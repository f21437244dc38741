from __future__ import annotations

import time

import pytest
import zmq

from common.cluster_auth import ClusterKey, control_sealer
from common.kv_transfer.config import ConnectionReopened, TransferError
from common.kv_transfer.control import ControlPlane
from common.kv_transfer.messages import Ok, Ping, decode, encode
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
        raw.send(encode(Ping(id=77)))  # one connection keeps order: answered = the garbage was read
        assert raw.poll(5000) and decode(raw.recv()) == Ok(id=77)
        assert got == [Ping(id=77)]
        assert isinstance(client.request(server.address, Ping(), 2.0).result(3), Ok)
    finally:
        raw.close()
        ctx.term()
        client.close()
        server.close()


def test_request_to_silent_peer_fails_at_deadline(no_thread_leak):
    seen: list = []
    silent = ControlPlane("127.0.0.1:0", lambda i, m: seen.append(m), lambda a, m: None)
    client = ControlPlane("127.0.0.1:0", lambda i, m: None, lambda a, m: None)
    try:
        with pytest.raises(TransferError, match="no response from peer before the deadline"):
            client.request(silent.address, Ping(), 0.3).result(30)
        assert [type(m) for m in seen] == [Ping]  # delivered, never answered: the deadline failed it
    finally:
        client.close()
        silent.close()


def test_what_waits_on_a_connection_reopened_after_a_silent_request_fails_at_once(no_thread_leak):
    """A request that expires closes its connection (a partitioned peer's socket can stay stuck
    long after the link is back); a later request sent on that connection was lost with it and
    fails at once, naming it, instead of waiting out its own deadline; the next goes on a fresh one."""
    seen: list = []
    silent = ControlPlane("127.0.0.1:0", lambda i, m: seen.append(m), lambda a, m: None)
    client = ControlPlane("127.0.0.1:0", lambda i, m: None, lambda a, m: None)
    try:
        first = client.request(silent.address, Ping(), 0.3)
        later = client.request(silent.address, Ping(), 60.0)
        with pytest.raises(TransferError, match="no response from peer before the deadline"):
            first.result(30)
        with pytest.raises(ConnectionReopened, match="reopened after a silent request"):
            later.result(5)  # long before its own 60 s
        third = client.request(silent.address, Ping(), 0.3)
        with pytest.raises(TransferError, match="no response"):
            third.result(30)
        assert [type(m) for m in seen] == [Ping, Ping, Ping]
    finally:
        client.close()
        silent.close()


def _keyed_server(got: list, key) -> ControlPlane:
    box: dict = {}

    def on_router(identity, msg):
        got.append(msg)
        box["cp"].reply(identity, Ok(id=msg.id))

    box["cp"] = ControlPlane("127.0.0.1:0", on_router, lambda a, m: None, key=key)
    return box["cp"]


def test_with_a_key_only_members_are_answered(no_thread_leak):
    key = ClusterKey(b"0123456789abcdef-cluster")
    got: list = []
    server = _keyed_server(got, key)
    member = ControlPlane("127.0.0.1:0", lambda i, m: None, lambda a, m: None, key=key)
    stranger = ControlPlane("127.0.0.1:0", lambda i, m: None, lambda a, m: None,
                            key=ClusterKey(b"another-cluster-0123456789"))
    keyless = ControlPlane("127.0.0.1:0", lambda i, m: None, lambda a, m: None)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    try:
        assert isinstance(member.request(server.address, Ping(), 3.0).result(5), Ok)
        for outsider in (stranger, keyless):
            with pytest.raises(TransferError):
                outsider.request(server.address, Ping(), 0.5).result(3)
        sealed = control_sealer(key).frames(encode(Ping(id=99)))
        raw.connect(f"tcp://{server.address}")
        raw.send_multipart(sealed)
        raw.send_multipart(sealed)  # replayed: dropped
        assert raw.poll(3000)
        raw.recv_multipart()
        assert not raw.poll(500)
        assert [m.id for m in got].count(99) == 1 and len(got) == 2
    finally:
        raw.close()
        ctx.term()
        for cp in (member, stranger, keyless, server):
            cp.close()


def test_idle_connections_to_peers_are_closed_and_capped(no_thread_leak):
    got: list = []
    server = _server(got)
    client = ControlPlane("127.0.0.1:0", lambda i, m: None, lambda a, m: None, idle_s=0.3, max_peers=2)
    try:
        assert isinstance(client.request(server.address, Ping(), 2.0).result(3), Ok)
        for port in (1, 2, 3):  # nothing listens: fire-and-forget opens (capped) connections
            client.send(f"127.0.0.1:{port}", Ping())
        deadline = time.monotonic() + 5
        while client._dealers and time.monotonic() < deadline:
            time.sleep(0.05)
        assert client._dealers == {}
        assert isinstance(client.request(server.address, Ping(), 2.0).result(3), Ok)  # reopened on demand
    finally:
        client.close()
        server.close()
