"""The registration message and the Heartbeater against a real ROUTER (restarted midway)."""

from __future__ import annotations

import time

import msgpack
import pytest
import zmq

from common.registry_client import (PROTOCOL_VERSION, Heartbeater, RegistrationError, RegistrationMessage,
                                    decode, encode)


def test_round_trip_and_minimal_vllm_map():
    msg = RegistrationMessage("P", "h:1", "h:2", model="m", kv_fingerprint="f", version=1, num_running=2)
    assert decode(encode(msg)) == msg
    plain = RegistrationMessage("D", "h:1", "h:2")
    assert msgpack.unpackb(encode(plain)) == {"type": "D", "http_address": "h:1", "zmq_address": "h:2",
                                              "num_running": 0, "num_waiting": 0}
    # vLLM's own three-key map, and unknown keys from a newer sender, both parse.
    assert decode(msgpack.packb({"type": "P", "http_address": "a:1", "zmq_address": "a:2", "future": 1})).model is None


@pytest.mark.parametrize("frame", [
    b"\xc1",
    msgpack.packb([1]),
    msgpack.packb({"type": "Q", "http_address": "a:1", "zmq_address": "a:2"}),
    msgpack.packb({"type": "P", "http_address": "a:1"}),
])
def test_bad_frames_raise(frame):
    with pytest.raises(RegistrationError):
        decode(frame)


def _router(port: int | None = None) -> tuple[zmq.Context, zmq.Socket, int]:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if port is None:
        port = sock.bind_to_random_port("tcp://127.0.0.1")
    else:
        sock.bind(f"tcp://127.0.0.1:{port}")
    return ctx, sock, port


def _recv(sock: zmq.Socket, timeout_s: float = 3.0) -> RegistrationMessage:
    assert sock.poll(int(timeout_s * 1000)), "no heartbeat arrived"
    return decode(sock.recv_multipart()[-1])


def test_heartbeater_sends_the_first_beat_at_once():
    """The interval (60 s, the most allowed) outlasts the wait: a beat that arrives went out at start."""
    ctx, sock, port = _router()
    beat = Heartbeater(f"127.0.0.1:{port}", lambda: {"type": "P", "http_address": "h:1", "zmq_address": "h:2",
                                                     "model": "m"}, interval_s=60)
    beat.start()
    try:
        first = _recv(sock, timeout_s=30)
        assert first.version == PROTOCOL_VERSION and first.heartbeat_interval_s == 60 and first.model == "m"
    finally:
        beat.stop()
        sock.close()
        ctx.term()


def test_heartbeater_beats_every_interval_and_survives_a_restart():
    ctx, sock, port = _router()
    load = {"n": 0}

    def info() -> dict:
        load["n"] += 1
        return {"type": "D", "http_address": "h:1", "zmq_address": "h:2", "model": "m", "num_running": load["n"]}

    beat = Heartbeater(f"127.0.0.1:{port}", info, interval_s=0.1)
    beat.start()
    try:
        first = _recv(sock)
        assert _recv(sock).num_running > first.num_running  # info() is called for every beat
        sock.close()
        ctx.term()
        down_at = load["n"]
        deadline = time.monotonic() + 30
        while load["n"] < down_at + 3:  # the proxy is down; beats are dropped, the thread goes on
            assert time.monotonic() < deadline, "no beat tried while the proxy was down"
            time.sleep(0.02)
        ctx, sock, _ = _router(port)
        assert _recv(sock, timeout_s=30).type == "D"
    finally:
        beat.stop()
        sock.close()
        ctx.term()


def test_heartbeater_survives_a_failing_info():
    ctx, sock, port = _router()
    calls = {"n": 0}

    def info() -> dict:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("engine not ready")
        return {"type": "P", "http_address": "h:1", "zmq_address": "h:2"}

    beat = Heartbeater(f"127.0.0.1:{port}", info, interval_s=0.05)
    beat.start()
    try:
        assert _recv(sock).type == "P"
    finally:
        beat.stop()
        sock.close()
        ctx.term()


def test_heartbeat_carries_each_kv_tiers_measured_load_rate() -> None:
    """KV tiers (common/engine/kv_tiers.py): the rate each tier measured, by its events' medium; an
    unmeasured tier (0) is left out, and a node without tiers sends nothing new."""
    from common.engine.protocol import EngineStats
    from common.registry_client import adaptive_figures

    stats = EngineStats(0, 0, 1, 1, kv_tiers={"disk": {"load_bytes_per_s": 2.5e8}, "host": {"load_bytes_per_s": 0.0}})
    figures = adaptive_figures(stats)
    assert figures["kv_tier_load_bytes_per_s"] == {"DISK": 2.5e8}
    msg = RegistrationMessage.from_dict({"type": "P", "http_address": "127.0.0.1:8100",
                                         "zmq_address": "127.0.0.1:14579", **figures})
    assert msg.kv_tier_load_bytes_per_s == {"DISK": 2.5e8}
    assert "kv_tier_load_bytes_per_s" not in adaptive_figures(EngineStats(0, 0, 1, 1))
    with pytest.raises(RegistrationError):
        RegistrationMessage.from_dict({"type": "P", "http_address": "127.0.0.1:8100", "zmq_address": "127.0.0.1:1",
                                       "kv_tier_load_bytes_per_s": {"TAPE": 1.0}})


def test_heartbeater_reads_the_peers_of_the_registrys_answer(caplog: pytest.LogCaptureFixture) -> None:
    """``peers`` (--kv-peer-fetch) are checked as members are: a bad list voids the whole answer,
    and an answer without them (a registry from before them) names none."""
    from common.registry_client import encode_members

    ctx, sock, port = _router()
    beat = Heartbeater(f"127.0.0.1:{port}", lambda: {"type": "D", "http_address": "h:1", "zmq_address": "h:2",
                                                     "kv_peer_fetch": True}, interval_s=0.05)
    assert beat.peers == frozenset()
    beat.start()
    try:
        def answer(payload: bytes) -> None:
            assert sock.poll(3000), "no heartbeat arrived"
            sock.send_multipart([sock.recv_multipart()[0], payload])

        answer(encode_members(["p:1"], peers=["p:1", "d:3"]))
        deadline = time.monotonic() + 10
        while beat.peers != {"p:1", "d:3"}:
            assert time.monotonic() < deadline, "the answer's peers were not read"
            time.sleep(0.01)
        assert beat.members == {"p:1"}
        answered = beat.answered_at
        answer(msgpack.packb({"members": ["p:2"], "peers": ["not an address"]}))  # ignored whole
        answer(msgpack.packb({"members": ["p:2"], "peers": ["x:1"] * 5000}))  # too many
        answer(msgpack.packb({"members": ["p:3"]}))  # an older registry: no peers
        while beat.members != {"p:3"}:
            assert time.monotonic() < deadline, "the last answer was not read"
            time.sleep(0.01)
        assert beat.peers == frozenset() and beat.answered_at != answered
        assert sum("registry answer ignored" in r.getMessage() for r in caplog.records) == 2
    finally:
        beat.stop()
        sock.close()
        ctx.term()


def test_a_peer_fetcher_says_so_and_its_peer_rate() -> None:
    from common.engine.protocol import EngineStats
    from common.registry_client import adaptive_figures

    stats = EngineStats(0, 0, 1, 1, kv_tiers={"peer": {"load_bytes_per_s": 3e8}})
    assert adaptive_figures(stats)["kv_tier_load_bytes_per_s"] == {"PEER": 3e8}
    msg = RegistrationMessage.from_dict({"type": "P", "http_address": "127.0.0.1:8100", "zmq_address": "127.0.0.1:1",
                                         "kv_peer_fetch": True, "kv_tier_load_bytes_per_s": {"PEER": 3e8}})
    assert decode(encode(msg)) == msg and msg.kv_peer_fetch is True
    assert RegistrationMessage("P", "h:1", "h:2").kv_peer_fetch is None  # an older node: off
    with pytest.raises(RegistrationError):
        RegistrationMessage.from_dict({"type": "P", "http_address": "a:1", "zmq_address": "a:2", "kv_peer_fetch": 1})
