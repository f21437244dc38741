"""A heartbeat dropped because the connection was not up yet is tried again soon, not one
interval later: a daemon started before its proxy registers as soon as the proxy listens."""

from __future__ import annotations

import zmq

from common.registry_client import Heartbeater, decode
from helpers.ports import free_port


def test_a_dropped_first_beat_is_sent_again_long_before_the_interval() -> None:
    port = free_port()
    calls: list[int] = []

    def info() -> dict:
        calls.append(1)
        return {"type": "P", "http_address": "h:1", "zmq_address": "h:2"}

    beat = Heartbeater(f"127.0.0.1:{port}", info, interval_s=60.0)  # the next regular beat: a minute away
    beat.start()
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        while not calls:  # the first beat was attempted with nobody listening
            zmq.select([], [], [], 0.01)
        assert beat.beats_sent == 0
        router.bind(f"tcp://127.0.0.1:{port}")
        assert router.poll(30_000), "no heartbeat within half the interval after the proxy started listening"
        assert decode(router.recv_multipart()[-1]).type == "P"
    finally:
        beat.stop()
        router.close()
        ctx.term()
