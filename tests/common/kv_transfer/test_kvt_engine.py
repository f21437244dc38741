"""Two-process transfers: a producer engine in a child process, the consumer here."""

from __future__ import annotations

import threading
import time

import torch

from common.kv_transfer.config import TransferConfig, TransferStats
from common.kv_transfer.endpoint import KVEndpoint
from helpers.waiting import wait_for
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from kvt_peers import make_kv, peer, same_bytes

P_BLOCKS = 32  # blocks in the producer's paged cache
D_BLOCKS = 40


def wait_finished(engine: KVEndpoint, ids: set[str], timeout: float = 15.0):
    done: dict[str, int] = {}
    failed: dict[str, str] = {}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not ids <= (set(done) | set(failed)):
        d, f = engine.consumer.poll_finished()
        done.update(d)
        failed.update(f)
        time.sleep(0.02)
    return done, failed


def d_cache() -> list[torch.Tensor]:
    return [torch.zeros(LAYOUT.layer_shape(D_BLOCKS), dtype=LAYOUT.torch_dtype)
            for _ in range(LAYOUT.num_layers)]


def slow_transfer_under_way(p, d: KVEndpoint, kv: list[torch.Tensor]) -> None:
    """``d`` asks ``p`` for r1 (blocks 0..2), ``p`` sends it at 0.4 s a layer; returns once bytes landed
    (the moment a test kills or restarts the producer)."""
    d.consumer.request("r1", p.address, [0, 1, 2], 12, kv)
    assert p.call("wait_state", "r1", "pulled", 10) == "pulled"
    p.conn.send(("prefill", "r1", 1, P_BLOCKS, [3, 4, 5], 12, 7, True, 0.4))
    assert wait_for(lambda: d.stats.bytes_received > 0, 10)


def assert_landed(d_kv, d_ids, seed, p_ids, num_tokens):
    n = -(-num_tokens // LAYOUT.block_size)
    p_kv = make_kv(LAYOUT, P_BLOCKS, seed)
    for layer in range(LAYOUT.num_layers):
        assert same_bytes(d_kv[layer][:, d_ids[:n]], p_kv[layer][:, p_ids[:n]]), f"layer {layer}"


def test_consumer_asks_first_layers_pushed_during_prefill(no_thread_leak):
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        kv = d_cache()
        d_ids, p_ids = [7, 3, 30, 12, 5], [9, 1, 20, 4, 17]  # non-contiguous on both sides
        d.consumer.request("r1", p.address, d_ids, 18, kv)
        assert p.call("wait_state", "r1", "pulled", 10) == "pulled"  # PULL reached P before prefill
        assert d.consumer.transfer_state("r1") == "pulled"
        assert p.call("prefill", "r1", 11, P_BLOCKS, p_ids, 18, 1234, True, 0.0) == "ok"
        assert p.call("eager", "r1") == LAYOUT.num_layers  # every layer queued by save_layer, before finish
        deadline = time.monotonic() + 15
        while d.consumer.transfer_state("r1") != "landed":  # not yet polled
            assert time.monotonic() < deadline, d.consumer.transfer_state("r1")
            time.sleep(0.02)
        done, failed = wait_finished(d, {"r1"})
        assert (done, failed) == ({"r1": 1234}, {})
        assert d.consumer.transfer_state("r1") == "unknown"
        assert_landed(kv, d_ids, 11, p_ids, 18)
        assert p.call("freeable", 5, ["r1"]) == ["r1"]  # ACK frees P's blocks
        stats = p.call("stats")
        assert stats["bytes_sent"] == LAYOUT.num_layers * 5 * LAYOUT.bytes_per_block_per_layer()
        assert d.stats.bytes_received == stats["bytes_sent"] and d.stats.transfers_received == 1
        assert stats["transfers_sent"] == 1 and stats["transfer_seconds_sum"] > 0  # timed up to the ACK
        p.stop()


def test_staging_budget_bounds_eager_sends_rest_follows_from_blocks(no_thread_leak):
    # P in this process so its budget can be inspected; D in a child.
    tiny = TransferConfig(**dict(FAST, max_bytes_in_flight=LAYOUT.bytes_per_block_per_layer() * 3))
    with KVEndpoint("127.0.0.1:0", LAYOUT, tiny) as prod, peer(LAYOUT, FAST) as d:
        kv = make_kv(LAYOUT, P_BLOCKS, 21)
        p_ids = [8, 2, 6]
        d.call("request", "bud", prod.address, [0, 1, 2], 12, 4)
        deadline = time.monotonic() + 10
        while prod.producer.request_state("bud") != "pulled":
            assert time.monotonic() < deadline, "PULL never arrived"
            time.sleep(0.02)
        for layer in range(LAYOUT.num_layers):  # 3 blocks per layer: only one layer fits at a time
            prod.producer.save_layer("bud", layer, kv[layer], p_ids)
            assert prod.producer._budget.in_flight <= tiny.max_bytes_in_flight
        prod.producer.finish("bud", 3, kv, p_ids, 12)
        # past HELD: every layer went eagerly, so only DONE was left, and on a loaded machine the
        # consumer's ACK can come before this line runs ("unknown": acknowledged, not yet polled)
        assert prod.producer.request_state("bud") in ("sending", "awaiting_ack", "unknown")
        assert d.call("poll", 10, ["bud"]) == ({"bud": 3}, {})
        got = d.call("fetch", "bud")
        assert all(same_bytes(got[i][:, [0, 1, 2]], kv[i][:, p_ids]) for i in range(LAYOUT.num_layers))
        assert prod.producer._budget.in_flight == 0
        deadline = time.monotonic() + 10
        while "bud" not in prod.producer.poll_freeable():  # the ACK frees it and forgets it
            assert time.monotonic() < deadline, prod.producer.request_state("bud")
            time.sleep(0.02)
        assert prod.producer.request_state("bud") == "unknown"
        d.stop()


def test_transfer_stats_callback_reports_each_request(no_thread_leak):
    seen: list[tuple[float, int]] = []
    stats = TransferStats(on_transfer=lambda seconds, nbytes: seen.append((seconds, nbytes)))
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST), stats) as d:
        p.call("prefill", "s", 1, P_BLOCKS, [0, 1], 8, 1, True, 0.0)
        d.consumer.request("s", p.address, [0, 1], 8, d_cache())
        assert wait_finished(d, {"s"}) == ({"s": 1}, {})
        assert len(seen) == 1 and seen[0][0] > 0
        assert seen[0][1] == LAYOUT.num_layers * 2 * LAYOUT.bytes_per_block_per_layer()
        # the rate the decode node reports to the proxy: bytes over first byte to DONE, which is
        # no longer than the histogram's PULL to DONE
        assert stats.recv_bytes_per_s is not None and stats.recv_bytes_per_s >= seen[0][1] / seen[0][0]
        p.stop()


def test_producer_finishes_first_then_consumer_asks(no_thread_leak):
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        p_ids, d_ids = [4, 5, 6, 7], [10, 11, 12, 13]  # contiguous runs take the slice path
        assert p.call("prefill", "r2", 5, P_BLOCKS, p_ids, 13, 99, True, 0.0) == "ok"
        assert p.call("wait_state", "r2", "held", 0) == "held"  # under its lease, nobody asked yet
        kv = d_cache()
        d.consumer.request("r2", p.address, d_ids, 13, kv)
        assert wait_finished(d, {"r2"}) == ({"r2": 99}, {})
        assert_landed(kv, d_ids, 5, p_ids, 13)
        assert torch.count_nonzero(kv[0][:, 14:]) == 0  # nothing written outside the blocks
        p.stop()


def test_many_concurrent_requests_over_one_pair(no_thread_leak):
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        kv = d_cache()
        reqs = {f"m{i}": ([i * 2, i * 2 + 1], [31 - i, i], 5 + i) for i in range(12)}
        for rid, (d_ids, p_ids, seed) in list(reqs.items())[:6]:  # half ask first
            d.consumer.request(rid, p.address, d_ids, 8, kv)
        for rid, (d_ids, p_ids, seed) in reqs.items():
            p.call("prefill", rid, seed, P_BLOCKS, p_ids, 8, seed, int(rid[1:]) % 2 == 0, 0.0)
        for rid, (d_ids, p_ids, seed) in list(reqs.items())[6:]:
            d.consumer.request(rid, p.address, d_ids, 8, kv)
        done, failed = wait_finished(d, set(reqs))
        assert failed == {} and done == {rid: seed for rid, (_, _, seed) in reqs.items()}
        for rid, (d_ids, p_ids, seed) in reqs.items():
            assert_landed(kv, d_ids, seed, p_ids, 8)
        assert sorted(p.call("freeable", 5, list(reqs))) == sorted(reqs)
        p.stop()


def test_one_consumer_two_producers(no_thread_leak):
    with peer(LAYOUT, FAST) as p1, peer(LAYOUT, FAST) as p2, \
            KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        kv = d_cache()
        d.consumer.request("a", p1.address, [0, 1], 8, kv)
        d.consumer.request("b", p2.address, [3, 2], 8, kv)  # run on P, not on D: staged halves
        p1.call("prefill", "a", 1, P_BLOCKS, [5, 6], 8, 1, True, 0.0)
        p2.call("prefill", "b", 2, P_BLOCKS, [5, 6], 8, 2, True, 0.0)
        assert wait_finished(d, {"a", "b"}) == ({"a": 1, "b": 2}, {})
        assert_landed(kv, [0, 1], 1, [5, 6], 8)
        assert_landed(kv, [3, 2], 2, [5, 6], 8)
        p1.stop()
        p2.stop()


def test_on_progress_wakes_the_consumer_and_the_producer_when_there_is_news(no_thread_leak):
    """The daemons' engine threads wait on ``on_progress`` instead of polling on a timer: it
    must fire for a landing, a failure, and (on the producer) an ACK that frees blocks."""
    news = threading.Event()
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST),
                                                   on_progress=news.set) as d:
        assert p.call("prefill", "w", 3, P_BLOCKS, [0, 1], 8, 42, True, 0.0) == "ok"
        d.consumer.request("w", p.address, [5, 6], 8, d_cache())
        assert news.wait(15), "no wake-up for a landed transfer"
        assert d.consumer.poll_finished() == ({"w": 42}, {})
        news.clear()
        d.consumer.request("gone", "127.0.0.1:1", [0, 1], 8, d_cache())  # nobody listens there
        assert news.wait(15), "no wake-up for a failed transfer"
        done, failed = d.consumer.poll_finished()
        assert done == {} and "gone" in failed
        p.stop()
    freed = threading.Event()
    with KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST), on_progress=freed.set) as prod, \
            peer(LAYOUT, FAST) as c:
        kv = make_kv(LAYOUT, P_BLOCKS, 8)
        prod.producer.finish("a", 7, kv, [2, 3], 8)
        c.call("request", "a", prod.address, [0, 1], 8, 4)
        assert c.call("poll", 15, ["a"]) == ({"a": 7}, {})
        assert freed.wait(15), "no wake-up for the ACK"
        assert prod.producer.poll_freeable() == {"a"}
        c.stop()
