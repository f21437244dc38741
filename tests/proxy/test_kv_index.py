"""The proxy's index of the daemons' KV events: bounded and least recently used first; fed by a
subscriber that syncs a late joiner by replay, repairs a gap with a snapshot, re-indexes a
restarted daemon from empty, forgets a silent one's cache, and outlives garbage."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import zmq
from helpers.waiting import wait_until

from common.cluster_auth import ClusterKey, kv_events_sealer
from common.engine.block_manager import BlockManager
from common.kv_events import encode_batch, seq_bytes
from common.node.kv_event_publisher import KVEventPublisher
from common.registry_client import RegistrationMessage
from proxy.kv_index import KVIndex
from proxy.kv_subscriber import KVEventSubscriber
from proxy.registry import ServiceRegistry

ROOT = b"r" * 16
D1, D2 = ("D", "127.0.0.1:8201"), ("D", "127.0.0.1:8202")


def hashes(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag, i]) * 8 for i in range(n)]


def test_bound_evicts_least_recently_used() -> None:
    index = KVIndex(max_blocks=3)
    a, b, c, d = hashes(4)
    index.stored(D1, [a, b, c])
    index.set_fresh(D1, True)
    assert index.leading([D1], [a]) == {D1: 1}  # a is now the most recently used
    index.stored(D2, [d])  # one over the bound: b, the least recently used, goes
    assert len(index) == 3 and index.evicted == 1
    assert index.leading([D1], [a, b]) == {D1: 1} and index.leading([D1], [c]) == {D1: 1}


def test_counts_only_fresh_nodes_and_their_leading_run() -> None:
    index = KVIndex()
    h = hashes(4)
    index.stored(D1, h[:3])
    index.stored(D2, [h[0], h[2]])
    assert index.leading([D1, D2], h) == {D1: 0, D2: 0}  # nobody fresh: cache-unknown
    index.set_fresh(D1, True)
    index.set_fresh(D2, True)
    assert index.leading([D1, D2], h) == {D1: 3, D2: 1}  # D2 lacks h[1]: its h[2] does not count
    index.removed(D1, [h[1]])
    assert index.leading([D1, D2], h) == {D1: 1, D2: 1}
    index.cleared(D1)
    assert index.leading([D1, D2], h) == {D1: 0, D2: 1}
    index.forget(D2)
    assert index.nodes() == {D1} and not index.is_fresh(D2)
    index.stored(D2, h[:1])  # back: a new number, nothing of before
    index.set_fresh(D2, True)
    assert index.leading([D1, D2], h) == {D1: 0, D2: 1}


@pytest.mark.parametrize("seed", range(3))
def test_random_events_agree_with_a_plain_model(seed: int) -> None:
    """Stores, removals, clears, departures and LRU evictions in any order: each node's leading run is
    what a plain per-node set (minus what the bound evicted) says, and every carried count is exact."""
    rng = random.Random(seed)
    nodes = [("D", f"127.0.0.1:{8200 + i}") for i in range(4)]
    index, model = KVIndex(max_blocks=40, max_nodes=6), {n: set() for n in nodes}
    pool = hashes(30, 1) + hashes(30, 2)
    for _ in range(2000):
        n, op = rng.choice(nodes), rng.random()
        batch = rng.sample(pool, rng.randint(1, 8))
        if op < 0.5:
            index.stored(n, batch)
            model[n] |= set(batch)
        elif op < 0.8:
            index.removed(n, batch)
            model[n] -= set(batch)
        elif op < 0.9:
            index.cleared(n)
            model[n] = set()
        else:
            index.forget(n)
            model[n] = set()
        kept = set(index._holders)
        for m in nodes:
            model[m] &= kept  # what the bound evicted is forgotten: under-counted, never over
            index.set_fresh(m, True)
            chain = rng.sample(pool, 5)
            want = next((i for i, h in enumerate(chain) if h not in model[m]), len(chain))
            assert index.leading([m], chain)[m] == want
        carried = [sum(1 for mask in index._holders.values() if mask >> b & 1) for b in range(6)]
        assert index._carried == carried and len(index) <= 40


def test_clearing_is_constant_time_and_numbers_come_back() -> None:
    """A cleared node's old bits stay in the masks until touched, meaning nothing; once no mask
    carries a retired number it is handed out again, and with every number carried a scan frees them."""
    index = KVIndex(max_nodes=2)
    h = hashes(6)
    index.stored(D1, h)
    index.set_fresh(D1, True)
    index.cleared(D1)  # D1's old number retired, a new one given: O(1)
    assert len(index) == 6 and index.leading([D1], h) == {D1: 0}
    index.stored(D1, h[:2])
    assert index.leading([D1], h) == {D1: 2}
    index.cleared(D1)  # both numbers now retired and carried: the scan strips them
    assert index.nodes() == {D1} and index.leading([D1], h) == {D1: 0}
    index.stored(D1, h[:1])
    assert index.leading([D1], h) == {D1: 1} and sorted(index._carried) == [0, 1]
    index.removed(D1, h[:1])
    index.stored(D2, h[3:4])  # a second node gets the other number
    index.set_fresh(D2, True)
    assert index.leading([D2], h[3:]) == {D2: 1} and sum(index._carried) == 1


# ---- the subscriber against real publishers -------------------------------------------------

class Daemon:
    """A block manager and its publisher, and the heartbeat a daemon would send."""

    def __init__(self, registry: ServiceRegistry, node: tuple[str, str], blocks: int = 16, **kw) -> None:
        self.registry, self.key = registry, node
        self.bm = BlockManager(blocks, 4, True)
        self.pub = KVEventPublisher("127.0.0.1", "127.0.0.1", 4, self.bm.cached_hashes, **kw)
        self.bm.events = self.pub.put
        self.pub.start()
        self.beat()

    def beat(self) -> None:
        self.registry.register(RegistrationMessage(
            type=self.key[0], http_address=self.key[1], zmq_address="127.0.0.1:1", block_size=4,
            **self.pub.heartbeat(ROOT)))

    def cache(self, chain: list[bytes]) -> list[int]:
        blocks = self.bm.allocate(len(chain))
        for i, (b, h) in enumerate(zip(blocks, chain)):
            self.bm.cache_block(b, h, chain[i - 1] if i else None, (i,) * 4)
        return blocks

    def indexed(self, index: KVIndex) -> bool:
        """The index holds exactly this daemon's cached blocks (and the daemon published all)."""
        cached = self.bm.cached_hashes()
        return (self.pub._queue.empty() and index.is_fresh(self.key)
                and all(index.leading([self.key], [h])[self.key] == 1 for h in cached)
                and sum(index.leading([self.key], [h])[self.key] for h in hashes(16, 1) + hashes(16, 2)) == len(cached))


@pytest.fixture
def registry():
    return ServiceRegistry(port=0)  # not listening: the tests register as the listener would


@pytest.fixture
def started():
    made = []

    def start(*args, **kw):
        made.append(obj := args[0](*args[1:], **kw))
        if hasattr(obj, "start"):
            obj.start()
        return obj

    yield start
    for obj in reversed(made):
        (obj.pub.stop if isinstance(obj, Daemon) else obj.stop)()


@pytest.mark.parametrize("key", [None, ClusterKey(b"k" * 32)], ids=["keyless", "keyed"])
def test_late_joiner_syncs_then_follows_live(registry, started, key) -> None:
    index = KVIndex()
    d1 = started(Daemon, registry, D1, key=key)
    d1.cache(hashes(3, 1))  # before the proxy subscribed: only a replay can tell it
    sub = started(KVEventSubscriber, registry, index, key=key)
    wait_until(lambda: d1.indexed(index), "D1's cache indexed by replay")
    blocks = d1.cache(hashes(2, 2))
    wait_until(lambda: d1.indexed(index), "live stores indexed")
    d1.bm.free(blocks)
    d1.bm.allocate(d1.bm.num_free_blocks)  # evicts every unheld cached block
    wait_until(lambda: d1.indexed(index) and index.leading([D1], hashes(2, 2))[D1] == 0, "evictions indexed")
    assert sub.replays_asked == 0 and sub.rejected() == {}


def test_gap_from_dropped_events_is_repaired_by_snapshot(registry, started) -> None:
    index = KVIndex()
    d1 = started(Daemon, registry, D1, max_queue=1, buffer_bytes=1)
    sub = started(KVEventSubscriber, registry, index)
    wait_until(lambda: index.is_fresh(D1), "synced")
    d1.cache(hashes(6, 1))  # a queue of one: most are dropped, the next number is skipped
    assert d1.pub.dropped > 0
    d1.beat()  # the heartbeat says how far it published: the proxy sees it is behind
    wait_until(lambda: (d1.beat(), d1.indexed(index))[1], "the snapshot repaired the index")
    assert sub.replays_asked >= 1 and d1.pub.snapshots >= 1


def test_restarted_daemon_is_reindexed_from_empty(registry, started) -> None:
    index = KVIndex()
    old = started(Daemon, registry, D1)
    old.cache(hashes(3, 1))
    started(KVEventSubscriber, registry, index)
    wait_until(lambda: old.indexed(index), "indexed")
    new = started(Daemon, registry, D1)  # same node, new process: new epoch, empty cache
    new.cache(hashes(1, 2))
    wait_until(lambda: new.indexed(index) and index.leading([D1], hashes(3, 1))[D1] == 0,
               "the old cache forgotten, the new one indexed")


def test_silent_node_goes_cache_unknown_and_a_departed_one_is_forgotten(registry, started) -> None:
    index = KVIndex()
    d1 = started(Daemon, registry, D1)
    d1.cache(hashes(2, 1))
    started(KVEventSubscriber, registry, index, stale_s=0.5)
    wait_until(lambda: d1.indexed(index), "indexed")
    wait_until(lambda: not index.is_fresh(D1), "no heartbeat confirms its events: cache-unknown")
    # a heartbeat confirming the last number: fresh again (beating on while waiting: on a loaded
    # machine one beat can go stale again, after stale_s, before the wait looks)
    wait_until(lambda: d1.beat() or index.is_fresh(D1), "a heartbeat confirming the last number: fresh again")
    registry.register(RegistrationMessage(type="D", http_address=D1[1], zmq_address="127.0.0.1:1", goodbye=True))
    wait_until(lambda: D1 not in index.nodes(), "its blocks forgotten once it left")


def test_a_subscriber_may_follow_only_the_peer_fetchers(registry, started) -> None:
    """Without a policy that reads prefixes the proxy follows only nodes running --kv-peer-fetch
    (the peer hint reads their events): another node's events are never subscribed to."""
    index = KVIndex()
    d1, d2 = started(Daemon, registry, D1), started(Daemon, registry, D2)
    registry.register(RegistrationMessage(**{**registry.get(*D2).info.to_dict(), "kv_peer_fetch": True}))
    d1.cache(hashes(2, 1))
    d2.cache(hashes(2, 2))
    sub = started(KVEventSubscriber, registry, index, follows=lambda node: bool(node.kv_peer_fetch))
    wait_until(lambda: d2.indexed(index), "the peer fetcher's cache indexed")
    assert set(sub.applied()) == {D2} and not index.is_fresh(D1)


@pytest.mark.parametrize("key", [None, ClusterKey(b"k" * 32)])
def test_garbage_and_unsealed_batches_are_dropped_and_counted(registry, started, key) -> None:
    index = KVIndex()
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    router = ctx.socket(zmq.ROUTER)
    replay_port = router.bind_to_random_port("tcp://127.0.0.1")
    try:
        registry.register(RegistrationMessage(type="D", http_address=D1[1], zmq_address="127.0.0.1:1", block_size=4,
                                              kv_events={"endpoint": f"127.0.0.1:{port}", "replay": f"127.0.0.1:{replay_port}",  # type: ignore[arg-type]
                                                         "epoch": "ab" * 8, "seq": -1, "root": ROOT.hex()}))
        sub = started(KVEventSubscriber, registry, index, key=key)
        assert router.poll(5000)
        asked = router.recv_multipart()
        assert asked[1:3] == [b"", seq_bytes(0)] and len(asked) == 3 + (key is not None)
        router.send_multipart([asked[0], b"", seq_bytes(-1), b""])  # an unsealed END
        garbage = [[b"", b"\x00" * 3, b"x"], [b"", seq_bytes(0), b"\xc1"], [b""],
                   [b"", seq_bytes(0), encode_batch([["BlockStored", [b"h" * 16], None, [], 4, None, None]])]]

        def dropped() -> int:
            for frames in garbage:
                pub.send_multipart(frames)
            return sum(sub.rejected().values())

        wait_until(lambda: dropped() >= 4, "garbage counted (after the SUB connected)")
        reasons = Counter(sub.rejected())
        if key is None:  # keyless is vLLM's wire: the END and the well-formed batch are taken
            assert reasons["invalid"] > 0, reasons  # a short sequence frame, not msgpack
            wait_until(lambda: (dropped(), index.leading([D1], [b"h" * 16])[D1] == 1)[1], "the good batch indexed")
        else:  # nothing unsealed (or sealed with another key) is taken: still syncing, nothing indexed
            batch = garbage[-1]
            other = kv_events_sealer(ClusterKey(b"o" * 32)).frames(batch[1] + batch[2])[1]
            wait_until(lambda: (pub.send_multipart([*batch, other]), sub.rejected().get("bad_signature"))[1],
                       "a seal of another key refused")
            assert reasons["frame_count"] > 0 and len(index) == 0 and not index.is_fresh(D1)
        assert sub._thread is not None and sub._thread.is_alive()
    finally:
        ctx.destroy(linger=0)
