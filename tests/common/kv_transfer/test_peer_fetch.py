"""The peer tier's network half (common/kv_transfer/peer_fetch.py): two real KV endpoints in this
process, one serving blocks from a table (as the engine's ``peer_blocks`` does from its pool), one
fetching them."""

from __future__ import annotations

import math
import threading
from concurrent.futures import Future

import pytest
import torch

from common.cluster_auth import ClusterKey
from common.kv_transfer import peer_fetch
from common.kv_transfer.endpoint import KVEndpoint
from common.kv_transfer.messages import Blocks
from helpers.waiting import wait_until
from kvt_fixtures import LAYOUT

SHAPE = (LAYOUT.num_layers, 2, LAYOUT.block_size, LAYOUT.num_kv_heads, LAYOUT.head_dim)
BLOCK_BYTES = math.prod(SHAPE) * LAYOUT.torch_dtype.itemsize
HASHES = [bytes([i]) * 16 for i in range(10)]
KV = {h: torch.randn(SHAPE).to(LAYOUT.torch_dtype) for h in HASHES}


def _held(hashes: list[bytes], held: set[bytes]) -> tuple[int, bytes]:
    run = []
    for h in hashes:
        if h not in held:
            break
        run.append(KV[h])
    if not run:
        return 0, b""
    return len(run), torch.stack(run).contiguous().view(-1).view(torch.uint8).numpy().tobytes()


class Pair:
    """A serving endpoint and a fetching one; ``held`` is what the server's pool has."""

    def __init__(self, key: ClusterKey | None = None, server_key: ClusterKey | None = None, timeout_s: float = 2.0):
        self.server = KVEndpoint("127.0.0.1:0", LAYOUT, role="decode", key=server_key or key)
        self.client = KVEndpoint("127.0.0.1:0", LAYOUT, role="decode", key=key)
        self.held: set[bytes] = set(HASHES)
        self.hang_after: int | None = None  # serve this many fetches, then never answer
        self.calls = 0
        self.closed = False
        self.news = threading.Event()
        self.server.peers.serve = self._serve
        self.fetcher = self.client.peer_fetcher(timeout_s, self.news.set)

    def _serve(self, hashes: list[bytes]) -> Future:
        self.calls += 1
        future: Future = Future()
        if self.hang_after is None or self.calls <= self.hang_after:
            future.set_result(_held(hashes, self.held))
        return future

    def fetch(self, hashes: list[bytes], job: str = "job") -> list[torch.Tensor]:
        self.fetcher.load(job, self.server.address, hashes)
        got: list = []
        wait_until(lambda: got.extend(self.fetcher.take_loaded()) or got, "the fetch to end", timeout=20)
        assert [j for j, _ in got] == [job]
        return got[0][1]

    def close(self) -> None:
        if not self.closed:  # once: a test may close it before the fixture does
            self.closed = True
            self.client.close()
            self.server.close()


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def _same(got: list[torch.Tensor], hashes: list[bytes]) -> bool:
    return len(got) == len(hashes) and all(torch.equal(t, KV[h]) for t, h in zip(got, hashes))


def test_blocks_arrive_in_chunks_byte_for_byte(pair, monkeypatch):
    pair.fetcher.chunk = 3  # 10 blocks: four answers
    got = pair.fetch(HASHES)
    assert _same(got, HASHES)
    assert pair.calls == 4 and pair.server.peers.served_blocks == 10
    assert pair.fetcher.pending == 0 and pair.fetcher.failures == 0


def test_only_the_leading_blocks_the_peer_holds_land(pair):
    pair.held = set(HASHES[:4]) | {HASHES[6]}  # a hole at 4: block 6 cannot be used
    got = pair.fetch(HASHES)
    assert _same(got, HASHES[:4])
    assert pair.fetcher.failures == 1


def test_a_peer_that_stops_answering_mid_fetch_gives_the_chunks_before(monkeypatch):
    pair = Pair(timeout_s=0.5)
    try:
        pair.fetcher.chunk = 2
        pair.hang_after = 2  # answers two chunks, then is silent (a peer that died)
        got = pair.fetch(HASHES)
        assert _same(got, HASHES[:4])
        assert pair.fetcher.pending == 0
    finally:
        pair.close()


def test_a_dead_peer_gives_nothing_and_no_hang():
    pair = Pair(timeout_s=0.5)
    try:
        address = pair.server.address
        pair.server.close()
        pair.fetcher.load("job", address, HASHES)
        got: list = []
        wait_until(lambda: got.extend(pair.fetcher.take_loaded()) or got, "the fetch to give up", timeout=20)
        assert got == [("job", [])]
    finally:
        pair.client.close()


def test_a_damaged_block_and_what_follows_it_are_not_used(pair):
    count, data = _held(HASHES[:3], set(HASHES))
    sums = peer_fetch.block_checksums(data, count, BLOCK_BYTES)
    damaged = bytearray(data)
    damaged[BLOCK_BYTES + 5] ^= 0xFF  # block 1
    got = pair.fetcher._blocks(Blocks(count=3, data=bytes(damaged), checksums=sums), 3)
    assert _same(got, HASHES[:1])
    assert pair.fetcher._blocks(Blocks(count=3, data=data[:-1], checksums=sums), 3) == []  # short
    assert pair.fetcher._blocks(Blocks(count=4, data=data, checksums=sums), 3) == []  # more than asked


def test_refused_fetches_land_nothing(pair):
    pair.server.peers.serve = None  # --kv-peer-fetch off on the peer
    assert pair.fetch(HASHES) == []
    pair.server.peers.serve = pair._serve
    pair.fetcher.fingerprint = "another-layout"
    assert pair.fetch(HASHES, job="other") == []
    assert pair.server.peers.refused == 2 and pair.calls == 0


def test_a_stranger_without_the_cluster_key_gets_nothing():
    pair = Pair(key=ClusterKey(b"another-cluster-0123456789"), server_key=ClusterKey(b"0123456789abcdef-cluster"),
                timeout_s=0.5)
    try:
        assert pair.fetch(HASHES) == []
        assert pair.calls == 0  # dropped unopened: the engine was never asked
    finally:
        pair.close()


def test_with_the_cluster_key_blocks_arrive():
    key = ClusterKey(b"0123456789abcdef-cluster")
    pair = Pair(key=key)
    try:
        assert _same(pair.fetch(HASHES[:5]), HASHES[:5])
    finally:
        pair.close()


def test_ten_thousand_aborted_fetches_leave_nothing_on_either_side(pair):
    for batch in range(100):  # 100 at a time, cancelled once the peer has answered some of them
        jobs = [f"job-{batch}-{i}" for i in range(100)]
        calls = pair.calls
        for job in jobs:
            pair.fetcher.load(job, pair.server.address, HASHES[:1])
        wait_until(lambda: pair.calls > calls, "the peer to be asked", timeout=20)
        for job in jobs:
            pair.fetcher.cancel(job)
    assert pair.fetcher.pending == 0
    wait_until(lambda: pair.server.peers._serving == 0 and pair.client.control._pending == {},
               "the last answers to come back", timeout=60)
    assert pair.calls >= 100  # asked and answered, then dropped unread: cancelled while in flight
    assert pair.fetcher.take_loaded() == [] and pair.fetcher.pending == 0
    assert _same(pair.fetch(HASHES[:2], job="after"), HASHES[:2])  # and it still serves


def test_blocks_after_the_pool_come_from_the_file_tier_off_the_engine_thread(pair, tmp_path):
    """The engine's part holds 3 blocks; the server's file tier has the next 4 (then a hole): the
    asker gets all 7, read on the server's reader thread, and a damaged file ends the run there."""
    from common.engine.kv_file_tier import FileTier

    files = FileTier(str(tmp_path), "ns", 1 << 30, SHAPE, LAYOUT.torch_dtype)
    assert files.start()
    try:
        for h in HASHES[3:7]:
            files.put(h, KV[h])
        assert files.drain(10.0)
        pair.held = set(HASHES[:3])
        read_on: list[str] = []

        def rest(hashes: list[bytes]) -> tuple[int, bytes]:
            read_on.append(threading.current_thread().name)
            return files.read_run(hashes)

        pair.server.peers.serve_rest = rest
        got = pair.fetch(HASHES)
        assert _same(got, HASHES[:7])
        assert read_on == ["peer-serve-reader"]
        assert pair.server.peers.served_blocks == 7 and files.blocks_served == 4
        assert pair.server.peers._serving == 0

        path = files._path(HASHES[5])
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
        got = pair.fetch(HASHES, job="again")
        assert _same(got, HASHES[:5])  # blocks 0-2 held, 3-4 from files, 5 damaged: the run ends
        assert not path.exists() and files.load_errors == 1
        pair.close()  # the reader thread stops with its endpoint
        wait_until(lambda: not any(t.name == "peer-serve-reader" for t in threading.enumerate()),
                   "the peer reader thread to stop", timeout=10)
    finally:
        files.close()


def test_a_failing_file_read_still_sends_the_blocks_held(pair):
    pair.held = set(HASHES[:2])

    def broken(hashes: list[bytes]) -> tuple[int, bytes]:
        raise OSError("the volume is gone")

    pair.server.peers.serve_rest = broken
    got = pair.fetch(HASHES)
    assert _same(got, HASHES[:2])
    assert pair.server.peers._serving == 0 and pair.server.peers.served_blocks == 2
