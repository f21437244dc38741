"""The data plane's connect hello (issue 22 item 3), with and without a cluster key: strangers on
a pair's port are closed without holding up the honest consumer, a peer with another key builds
no pair, and a stranger on a gloo pair's store cannot break it."""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import uuid

import pytest
import torch
import torch.distributed as dist

from common.cluster_auth import ClusterKey
from common.kv_transfer import pair_auth
from common.kv_transfer.config import PairBrokenError
from common.kv_transfer.pair_auth import CHALLENGE_MAGIC, NONCE_BYTES
from common.kv_transfer.tcp_pair import TcpListener, TcpPair
from common.kv_transfer.transport import listen, open_pair

KEY = ClusterKey(b"k" * 32)


def _build_producer(listener: TcpListener, pair_id: str, key: ClusterKey | None) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["pair"] = TcpPair(0, 5.0, pair_id, listener=listener, connect_timeout_s=10.0, key=key)
        except PairBrokenError as e:
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _stranger(port: int, key: ClusterKey | None, pair_id: str, kind: str) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    if key is not None:
        challenge = s.recv(len(CHALLENGE_MAGIC) + NONCE_BYTES, socket.MSG_WAITALL)
        assert challenge.startswith(CHALLENGE_MAGIC)
    if kind == "garbage":
        s.sendall(os.urandom(200))
    elif kind == "forged":  # the right pair id (it travels in the clear), no key
        s.sendall(pair_id.encode() + os.urandom(NONCE_BYTES + 32) if key else uuid.uuid4().hex.encode())
    return s  # "silent": connected, says nothing


def _closed(s: socket.socket) -> bool:
    try:
        return s.recv(4096) == b""
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("key", [KEY, None], ids=["keyed", "keyless"])
def test_strangers_are_closed_and_an_honest_pair_is_not_held_up(key, monkeypatch):
    # a hello may take as long as the whole set-up: were hellos read one after another, the
    # silent stranger (first in line) would hold the honest consumer up past the joins below
    monkeypatch.setattr(pair_auth, "HELLO_TIMEOUT_S", 60.0)
    pair_id = uuid.uuid4().hex
    listener = TcpListener("127.0.0.1", 60.0)
    thread, out = _build_producer(listener, pair_id, key)
    silent = _stranger(listener.port, key, pair_id, "silent")
    garbage = _stranger(listener.port, key, pair_id, "garbage")
    forged = _stranger(listener.port, key, pair_id, "forged")

    consumer = TcpPair(1, 5.0, pair_id, host="127.0.0.1", port=listener.port, connect_timeout_s=10.0, key=key)
    thread.join(20)
    assert "pair" in out, out
    assert _closed(garbage) and _closed(forged) and _closed(silent)  # the port closes once ours is in

    sent = torch.arange(1000, dtype=torch.float32)
    got = torch.zeros_like(sent)
    out["pair"].send([sent])
    consumer.recv_into([got])
    assert torch.equal(sent, got)
    for s in (silent, garbage, forged):
        s.close()
    out["pair"].close()
    consumer.close()


def test_a_peer_with_another_key_builds_no_pair(caplog):
    pair_id = uuid.uuid4().hex
    listener = TcpListener("127.0.0.1", 2.0)
    thread, out = _build_producer(listener, pair_id, KEY)
    with caplog.at_level(logging.INFO, logger="common.kv_transfer.pair_auth"):
        with pytest.raises(PairBrokenError, match="does not hold our key"):
            TcpPair(1, 5.0, pair_id, host="127.0.0.1", port=listener.port, connect_timeout_s=10.0,
                    key=ClusterKey(b"x" * 32))
        thread.join(10)
    assert "no consumer joined" in str(out["error"]), out
    assert "failed the cluster-key proof" in caplog.text


def test_a_producer_with_another_key_is_not_trusted():
    pair_id = uuid.uuid4().hex
    listener = TcpListener("127.0.0.1", 2.0)
    thread, out = _build_producer(listener, pair_id, ClusterKey(b"x" * 32))
    with pytest.raises(PairBrokenError):
        TcpPair(1, 5.0, pair_id, host="127.0.0.1", port=listener.port, connect_timeout_s=10.0, key=KEY)
    thread.join(10)
    assert "error" in out


@pytest.mark.parametrize("key", [KEY, None], ids=["keyed", "keyless"])
def test_a_stranger_on_the_store_port_cannot_break_a_gloo_pair(key):
    pair_id = uuid.uuid4().hex
    store = listen("gloo", "127.0.0.1", 20.0)
    # a raw stranger sends garbage; a store client that knows the protocol (not the pair's
    # prefix) writes the keys an unprefixed gloo pair would read
    raw = socket.create_connection(("127.0.0.1", store.port), timeout=5)
    raw.sendall(os.urandom(4096))
    client = dist.TCPStore("127.0.0.1", store.port, 2, False, datetime.timedelta(seconds=5))
    for k in ("0/0", "0/1", pair_id, f"pdserve-pair/{uuid.uuid4().hex}/0/0"):  # gloo reads "0/<rank>"
        client.set(k, os.urandom(64))
    out: dict = {}

    def producer() -> None:
        out["pair"] = open_pair("gloo", 0, 5.0, pair_id, connect_timeout_s=20.0, rendezvous=store, key=key)

    t = threading.Thread(target=producer, daemon=True)
    t.start()
    consumer = open_pair("gloo", 1, 5.0, pair_id, connect_timeout_s=20.0, host="127.0.0.1", port=store.port,
                         key=key)
    t.join(20)
    assert "pair" in out
    sent = torch.arange(1000, dtype=torch.bfloat16)
    got = torch.zeros_like(sent)
    work = out["pair"].send_async([sent])  # gloo's send completes only once the peer receives
    consumer.recv_into([got])
    out["pair"].wait(work)
    assert torch.equal(sent, got)
    raw.close()
    out["pair"].close()
    consumer.close()
