"""Failure cases, each across real processes: dead peers, leases, aborts, refusals, garbage."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future

import pytest
import torch
import zmq

from common.kv_transfer.config import ConnectionReopened, TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from common.kv_transfer.messages import Pull
from helpers.waiting import wait_for
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from kvt_peers import Peer, make_kv, peer, same_bytes
from test_kvt_engine import P_BLOCKS, assert_landed, d_cache, slow_transfer_under_way, wait_finished


def test_producer_killed_mid_transfer_fails_fast_then_restarted_producer_works(no_thread_leak):
    p = Peer(LAYOUT, FAST)
    try:
        with KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
            kv = d_cache()
            slow_transfer_under_way(p, d, kv)
            p.kill()
            done, failed = wait_finished(d, {"r1"}, timeout=30)
            assert done == {} and "r1" in failed
            # noticed by the pair or the pings, not by the consumer's own give-up deadline
            assert "timed out waiting" not in failed["r1"], failed
            # Same address, new process: the consumer reconnects and builds a new pair.
            p = Peer(LAYOUT, FAST, address=p.address)
            d.consumer.request("r2", p.address, [6, 7], 8, kv)
            p.call("prefill", "r2", 2, P_BLOCKS, [1, 2], 8, 8, True, 0.0)
            assert wait_finished(d, {"r2"}) == ({"r2": 8}, {})
            assert_landed(kv, [6, 7], 2, [1, 2], 8)
            p.stop()
    finally:
        p.kill()


def test_consumer_killed_mid_transfer_frees_producer_blocks(no_thread_leak):
    cfg = TransferConfig(**FAST)
    with KVEndpoint("127.0.0.1:0", LAYOUT, cfg) as prod:
        p_kv = make_kv(LAYOUT, P_BLOCKS, 3)
        with peer(LAYOUT, FAST) as d:
            d.call("request", "r1", prod.address, [0, 1], 8, 4)
            assert wait_for(lambda: "r1" in prod.producer.table.records, 5)
            prod.producer.save_layer("r1", 0, p_kv[0], [1, 2])
            assert wait_for(lambda: prod.stats.bytes_sent > 0, 5)
            d.kill()
            for layer in range(1, LAYOUT.num_layers):
                prod.producer.save_layer("r1", layer, p_kv[layer], [1, 2])
            prod.producer.finish("r1", 5, p_kv, [1, 2], 8)
            freed: set[str] = set()
            assert wait_for(lambda: "r1" in (freed.update(prod.producer.poll_freeable()) or freed), 30)
            # freed because the send failed, not because the lease ran out
            assert prod.stats.failures == 1 and prod.stats.leases_expired == 0
            assert prod.producer._budget.in_flight == 0
        with peer(LAYOUT, FAST) as d2:  # a new consumer gets a fresh pair
            prod.producer.finish("r2", 6, p_kv, [3, 4], 8)
            d2.call("request", "r2", prod.address, [0, 1], 8, 4)
            assert d2.call("poll", 10, ["r2"]) == ({"r2": 6}, {})
            got = d2.call("fetch", "r2")
            assert all(same_bytes(got[i][:, [0, 1]], p_kv[i][:, [3, 4]]) for i in range(LAYOUT.num_layers))
            d2.stop()


def test_lease_expiry_frees_and_late_consumer_gets_an_error(no_thread_leak):
    with peer(LAYOUT, dict(FAST, lease_s=0.5)) as p, \
            KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        p.call("prefill", "late", 1, P_BLOCKS, [0, 1], 8, 3, True, 0.0)
        assert p.call("freeable", 5, ["late"]) == ["late"]
        assert p.call("stats")["leases_expired"] == 1
        d.consumer.request("late", p.address, [0, 1], 8, d_cache())
        done, failed = wait_finished(d, {"late"})
        assert done == {} and "lease expired" in failed["late"]
        p.stop()


def test_pull_for_a_request_the_producer_never_runs_expires(no_thread_leak):
    with peer(LAYOUT, dict(FAST, lease_s=0.5)) as p, \
            KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        d.consumer.request("ghost", p.address, [0, 1], 8, d_cache())
        assert p.call("wait_state", "ghost", "pulled", 10) == "pulled"
        # the producer's engine loop polls, which enforces leases: poll until this one expired
        assert wait_for(lambda: p.call("freeable", 0.05, []) is not None and p.call("stats")["leases_expired"],
                     15)
        done, failed = wait_finished(d, {"ghost"})
        assert done == {} and "lease expired" in failed["ghost"]
        p.stop()


def test_consumer_abort_drops_request_at_producer(no_thread_leak):
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        d.consumer.request("ab", p.address, [0, 1], 8, d_cache())
        assert p.call("wait_state", "ab", "pulled", 10) == "pulled"
        d.consumer.abort("ab")
        assert p.call("wait_state", "ab", "gone", 10) == "gone"  # the ABORT reached P
        assert wait_for(lambda: "ab" in d.consumer.poll_aborted(), 10)  # D may reuse the blocks
        p.call("prefill", "ab", 1, P_BLOCKS, [0, 1], 8, 3, True, 0.0)
        assert p.call("freeable", 5, ["ab"]) == ["ab"]  # freed at finish, nothing sent
        assert d.consumer.poll_finished() == ({}, {})
        # the pair still works for the next request
        kv = d_cache()
        d.consumer.request("ok", p.address, [2, 3], 8, kv)
        p.call("prefill", "ok", 4, P_BLOCKS, [5, 9], 8, 4, True, 0.0)
        assert wait_finished(d, {"ok"}) == ({"ok": 4}, {})
        assert_landed(kv, [2, 3], 4, [5, 9], 8)
        p.stop()


def test_layout_mismatch_refused_at_handshake_naming_differences(no_thread_leak):
    other = dataclasses.replace(LAYOUT, num_kv_heads=4, head_dim=8, dtype="float16")
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", other, TransferConfig(**FAST)) as d:
        kv = [torch.zeros(other.layer_shape(4), dtype=other.torch_dtype) for _ in range(other.num_layers)]
        d.consumer.request("mm", p.address, [0, 1], 8, kv)
        done, failed = wait_finished(d, {"mm"})
        assert done == {}
        msg = failed["mm"]
        assert "layout mismatch" in msg and "num_kv_heads: 2 != 4" in msg
        assert "head_dim: 16 != 8" in msg and "dtype: bfloat16 != float16" in msg
        p.stop()


def test_garbage_control_frames_dropped_engine_keeps_serving(no_thread_leak):
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        try:
            raw.connect(f"tcp://{p.address}")
            for frame in (b"junk", b"\x81\xa3cmd\xa4nope", b"\x83\xa1v\x01\xa3cmd\xa3ack\xa2id\x00"):
                raw.send(frame)
        finally:
            raw.close()
            ctx.term()
        kv = d_cache()
        d.consumer.request("g", p.address, [0], 4, kv)
        p.call("prefill", "g", 9, P_BLOCKS, [3], 4, 1, True, 0.0)
        assert wait_finished(d, {"g"}) == ({"g": 1}, {})
        p.stop()


def test_a_pull_lost_with_a_reopened_connection_is_asked_again_on_a_new_pair(no_thread_leak):
    """The race behind one red CI run of the restart test below (gloo): another request to the
    producer went unanswered, the control plane reopened the connection, and the link's only
    PULL, sent on the old one, failed with ConnectionReopened. It is asked again once, on a new
    pair, and lands; the lost pair is gone."""
    with peer(LAYOUT, FAST, transport="gloo") as p, \
            KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST), transport="gloo") as d:
        control, lost = d.consumer.control, []
        request = control.request

        def losing_the_first_pull(address, msg, timeout_s):
            if isinstance(msg, Pull) and not lost:
                lost.append(msg.pair_id)
                fut: Future = Future()
                fut.set_exception(ConnectionReopened("reopened after a silent request (test)"))
                return fut
            return request(address, msg, timeout_s)

        control.request = losing_the_first_pull
        kv = d_cache()
        p.call("prefill", "r", 1, P_BLOCKS, [0, 1], 8, 1, True, 0.0)
        d.consumer.request("r", p.address, [2, 3], 8, kv)
        assert wait_finished(d, {"r"}) == ({"r": 1}, {})
        assert_landed(kv, [2, 3], 1, [0, 1], 8)
        assert len(lost) == 1 and d.pair_counts() == {"gloo": 1}
        p.stop()


@pytest.mark.parametrize("transport", ["tcp", "gloo"])
def test_producer_restarted_while_the_pair_idled_next_request_builds_a_new_pair(transport, no_thread_leak):
    """tcp notices the closed socket before asking; gloo hears "unknown pair" and asks again."""
    p = Peer(LAYOUT, FAST, transport=transport)
    try:
        with KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST), transport=transport) as d:
            kv = d_cache()
            p.call("prefill", "a", 1, P_BLOCKS, [0, 1], 8, 1, True, 0.0)
            d.consumer.request("a", p.address, [0, 1], 8, kv)
            assert wait_finished(d, {"a"}) == ({"a": 1}, {})
            p.kill()  # nothing in flight: the consumer's pair just idles
            p = Peer(LAYOUT, FAST, address=p.address, transport=transport)
            p.call("prefill", "b", 2, P_BLOCKS, [3, 4], 8, 2, True, 0.0)
            d.consumer.request("b", p.address, [5, 6], 8, kv)
            assert wait_finished(d, {"b"}) == ({"b": 2}, {})
            assert_landed(kv, [5, 6], 2, [3, 4], 8)
            assert d.pair_counts() == {transport: 1}
            p.stop()
    finally:
        p.kill()


def test_a_slow_transfer_that_keeps_landing_layers_is_not_cut_off(no_thread_leak):
    """The consumer's give-up deadline (lease + timeout without a byte) runs from the latest
    landed layer, not from the request: a slow link or a slow prefill whose layers keep coming
    (here 4 layers 0.8 s apart, 3.2 s against a 2 s deadline) finishes."""
    short = TransferConfig(**dict(FAST, lease_s=1.0, timeout_s=1.0))
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, short) as d:
        kv = d_cache()
        d.consumer.request("slow", p.address, [0, 1, 2], 12, kv)
        assert p.call("wait_state", "slow", "pulled", 10) == "pulled"
        assert p.call("prefill", "slow", 3, P_BLOCKS, [3, 4, 5], 12, 9, True, 0.8) == "ok"
        assert wait_finished(d, {"slow"}) == ({"slow": 9}, {})
        assert_landed(kv, [0, 1, 2], 3, [3, 4, 5], 12)
