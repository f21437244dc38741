"""A control-plane flood must not wedge a node's KV path (issue 22, finding 1).

A burst of well-formed pings makes the control thread post thousands of replies to
itself; it must never block on its own wake-up socket, so a transfer still moves after.
"""

from __future__ import annotations

import time

import zmq

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from common.kv_transfer.messages import Ping, decode, encode
from helpers.zmq_peer import raw_dealer
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from kvt_peers import peer
from test_kvt_engine import P_BLOCKS, assert_landed, d_cache, wait_finished

FLOOD = 20_000


def _answered(sock: zmq.Socket, ping: Ping, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.send(encode(ping))
        while sock.poll(1000):
            if decode(sock.recv()).id == ping.id:
                return True
    return False


def test_ping_flood_then_a_transfer_still_completes(no_thread_leak):
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        with raw_dealer(p.address) as stranger:
            stranger.setsockopt(zmq.SNDHWM, 0)
            frame = encode(Ping(id=1))
            for _ in range(FLOOD):
                stranger.send(frame)
            # a ping sent after the burst is answered: the control thread got through it (replies
            # beyond the socket's high-water mark may be dropped; that is fine)
            assert _answered(stranger, Ping(id=2)), "the control thread is stuck after the flood"
        p_ids, d_ids = [4, 5, 6, 7], [10, 11, 12, 13]
        assert p.call("prefill", "r1", 5, P_BLOCKS, p_ids, 13, 99, True, 0.0) == "ok"
        kv = d_cache()
        d.consumer.request("r1", p.address, d_ids, 13, kv)
        assert wait_finished(d, {"r1"}) == ({"r1": 99}, {})
        assert_landed(kv, d_ids, 5, p_ids, 13)
        p.stop()
