"""The proxy's subscriptions to every daemon's KV events, kept in the index (``proxy/kv_index.py``).

One thread (``pdserve-kv-events``) owns every socket: per node a SUB to its PUB and a DEALER to
its replay ROUTER, both learned from the node's heartbeat (``kv_events``, common/registry_client.py).
A node's feed, in order:

1. *new* (first heartbeat naming events, or a new ``epoch``: the daemon restarted, its cache is
   new): the node's blocks are cleared from the index and a replay from sequence 0 is asked;
2. *syncing*: replayed batches are applied in order (a snapshot -- cleared, then every cached
   hash -- when the daemon no longer keeps them all); live batches that come meanwhile are kept
   (bounded) and applied after ``END_SEQ``. The node is cache-unknown until then;
3. *live*: each batch numbered one past the last applied is applied; a higher number is a gap
   (lost on the wire, or dropped by the daemon's full queue): a replay from the first missing
   number is asked (back to 2). A heartbeat saying the node published further than was applied,
   for longer than ``gap_grace_s``, is a gap too (the last batches may have been the lost ones);
4. the node stays *fresh* (its blocks count for routing) while every batch up to what its
   heartbeat confirms was applied within ``stale_s``; a node whose events and heartbeats stop
   goes cache-unknown, and its feed ends when the registry drops it.

Every frame is checked (count, seal under a cluster key, sequence, layout: common/kv_events.py);
a bad one is dropped and counted by reason (:meth:`KVEventSubscriber.rejected`), never raised.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from common.cluster_auth import ClusterKey, kv_events_sealer
from common.kv_events import (
    MAX_PAYLOAD_BYTES,
    Cleared,
    EventFormatError,
    Removed,
    Stored,
    WireEvent,
    decode_batch,
    open_frames,
    read_seq,
    seal_frames,
    seq_bytes,
)
from common.registry_client import RegistrationMessage, zmq_endpoint
from proxy.kv_index import KVIndex, NodeKey
from proxy.registry import ServiceRegistry

logger = logging.getLogger(__name__)
MAX_PENDING = 1024  # live batches kept while a replay runs


@dataclass
class _Feed:
    key: NodeKey
    epoch: str
    sub: zmq.Socket
    dealer: zmq.Socket
    applied: int = -1  # the last batch applied
    syncing_since: float | None = None  # a replay was asked and its END not seen
    replay_gap: bool = False  # the replay skipped a number: ask again at its end
    pending: dict[int, list[WireEvent]] = field(default_factory=dict)
    progress_at: float = 0.0  # when the index last was known complete for this node
    behind_since: float | None = None  # the heartbeat says more was published than applied
    heartbeat_at: float | None = None  # the registry's last_seen of the heartbeat last looked at

    def close(self) -> None:
        self.sub.close(linger=0)
        self.dealer.close(linger=0)


class KVEventSubscriber:
    """Subscribes to every registered node that advertises KV events (of those, the ones ``follows``
    accepts, when given); ``start``/``stop``."""

    def __init__(self, registry: ServiceRegistry, index: KVIndex, key: ClusterKey | None = None,
                 stale_s: float = 6.0, gap_grace_s: float = 1.0, replay_timeout_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 follows: Callable[[RegistrationMessage], bool] | None = None) -> None:
        self.registry, self.index, self.follows = registry, index, follows
        self.stale_s, self.gap_grace_s, self.replay_timeout_s = stale_s, gap_grace_s, replay_timeout_s
        self._clock = clock
        self._sealer = kv_events_sealer(key)
        self._feeds: dict[NodeKey, _Feed] = {}
        self._rejected: Counter[str] = Counter()
        self.replays_asked = 0
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def rejected(self) -> dict[str, int]:
        return dict(self._rejected)

    def applied(self) -> dict[NodeKey, int]:
        """The last batch applied, per node (a metric)."""
        return {k: f.applied for k, f in list(self._feeds.items())}

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="pdserve-kv-events", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                return  # its sockets are still open: term() would wait for them forever
            self._thread = None
        self._ctx.term()

    # ---- the thread ------------------------------------------------------------------------
    def _run(self) -> None:
        next_check = 0.0
        try:
            while not self._stop.is_set():
                try:
                    if self._clock() >= next_check:
                        self.check()
                        next_check = self._clock() + 0.1
                    self._poll(100)
                except Exception:
                    self._rejected["internal"] += 1
                    logger.exception("KV events: unexpected error; still subscribed")
        finally:
            for feed in self._feeds.values():
                feed.close()
            self._feeds.clear()

    def check(self) -> None:
        """Follow the registry (new nodes, restarted ones, departed ones) and each node's heartbeat."""
        now = self._clock()
        nodes = {n.key: n for n in self.registry.nodes()
                 if n.info.kv_events is not None and (self.follows is None or self.follows(n.info))}
        for key in [k for k in self._feeds if k not in nodes]:
            self._drop(key)
        for key, node in nodes.items():
            info = node.info.kv_events
            assert info is not None
            feed = self._feeds.get(key)
            if feed is not None and feed.epoch != info.epoch:
                logger.info("KV events: %s %s restarted (new epoch): its cache is indexed from empty", *key)
                self._drop(key)
                feed = None
            if feed is None:
                feed = self._subscribe(key, info.epoch, info.endpoint, info.replay)
            if node.last_seen != feed.heartbeat_at:  # a new heartbeat: does it confirm what was applied?
                feed.heartbeat_at = node.last_seen
                if info.seq <= feed.applied:
                    feed.behind_since = None
                    feed.progress_at = now
                elif feed.behind_since is None:
                    feed.behind_since = now
            if feed.behind_since is not None and info.seq <= feed.applied:
                feed.behind_since = None
            if feed.syncing_since is None and feed.behind_since is not None and now - feed.behind_since > self.gap_grace_s:
                self._ask_replay(feed, "heartbeat_ahead")
            elif feed.syncing_since is not None and now - feed.syncing_since > self.replay_timeout_s:
                self._ask_replay(feed, "replay_timeout")
            self.index.set_fresh(key, feed.syncing_since is None and now - feed.progress_at < self.stale_s)

    def _subscribe(self, key: NodeKey, epoch: str, endpoint: str, replay: str) -> _Feed:
        sub, dealer = self._ctx.socket(zmq.SUB), self._ctx.socket(zmq.DEALER)
        for sock in (sub, dealer):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_PAYLOAD_BYTES + 4096)  # libzmq drops a bigger one unread
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
            sock.setsockopt(zmq.IPV6, int(endpoint.startswith("[")))  # an IPv6 node: [addr]:port
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(zmq_endpoint(endpoint))
        dealer.connect(zmq_endpoint(replay))
        feed = self._feeds[key] = _Feed(key, epoch, sub, dealer)
        self.index.cleared(key)
        self._ask_replay(feed, None)
        logger.info("KV events: subscribed to %s %s at %s", *key, endpoint)
        return feed

    def _drop(self, key: NodeKey) -> None:
        feed = self._feeds.pop(key, None)
        if feed is not None:
            feed.close()
        self.index.forget(key)

    def _ask_replay(self, feed: _Feed, why: str | None) -> None:
        start = seq_bytes(feed.applied + 1)
        try:
            feed.dealer.send_multipart(seal_frames(self._sealer, [b"", start], start), zmq.NOBLOCK)
        except zmq.Again:
            pass  # not connected yet: asked again at the replay timeout
        feed.syncing_since, feed.replay_gap, feed.behind_since = self._clock(), False, None
        self.index.set_fresh(feed.key, False)
        if why is not None:
            self.replays_asked += 1
            logger.info("KV events: %s %s: %s; replay from %d asked", *feed.key, why, feed.applied + 1)

    def _poll(self, timeout_ms: int) -> None:
        poller = zmq.Poller()
        for feed in self._feeds.values():
            poller.register(feed.sub, zmq.POLLIN)
            poller.register(feed.dealer, zmq.POLLIN)
        if not self._feeds:
            self._stop.wait(timeout_ms / 1000)
            return
        ready = dict(poller.poll(timeout_ms))
        for feed in list(self._feeds.values()):
            if feed.sub in ready:
                self._read(feed, feed.sub, live=True)
            if feed.dealer in ready and feed.key in self._feeds:
                self._read(feed, feed.dealer, live=False)

    def _read(self, feed: _Feed, sock: zmq.Socket, live: bool) -> None:
        for _ in range(1000):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            # live: [topic, seq, payload]; replay: [b"", seq, payload]; either (, seal)
            reason = open_frames(self._sealer, frames, 3, slice(1, 3))
            try:
                if reason is not None:
                    raise EventFormatError(reason)
                seq = read_seq(frames[1])
                if not live and seq == -1:
                    self._replay_ended(feed)
                    continue
                events = decode_batch(frames[2])
            except EventFormatError as exc:
                self._rejected[str(exc) if reason else "invalid"] += 1
                continue
            if live:
                self._live(feed, seq, events)
            else:
                self._replayed(feed, seq, events)

    def _live(self, feed: _Feed, seq: int, events: list[WireEvent]) -> None:
        if feed.syncing_since is not None:
            if len(feed.pending) < MAX_PENDING:
                feed.pending[seq] = events
            return
        if seq <= feed.applied:
            return  # already had it (replayed)
        if seq == feed.applied + 1:
            self._apply(feed, seq, events)
        else:
            self._ask_replay(feed, f"gap ({feed.applied} then {seq})")

    def _replayed(self, feed: _Feed, seq: int, events: list[WireEvent]) -> None:
        if feed.syncing_since is None or seq <= feed.applied:
            return
        if seq == feed.applied + 1 or (events and isinstance(events[0], Cleared)):  # next, or a snapshot
            self._apply(feed, seq, events)
        else:
            feed.replay_gap = True

    def _replay_ended(self, feed: _Feed) -> None:
        if feed.syncing_since is None:
            return
        feed.syncing_since = None
        pending, feed.pending = feed.pending, {}
        if feed.replay_gap:
            self._ask_replay(feed, "gap in the replay")
            feed.pending = pending
            return
        feed.progress_at = self._clock()
        for seq in sorted(pending):
            self._live(feed, seq, pending[seq])
        self.index.set_fresh(feed.key, feed.syncing_since is None)

    def _apply(self, feed: _Feed, seq: int, events: list[WireEvent]) -> None:
        for event in events:
            if isinstance(event, (Stored, Removed)) and event.medium is not None:
                index = self.index.tier(event.medium)  # a KV tier's block (common/engine/kv_tiers.py)
                if index is None:
                    continue  # a medium we do not weigh: never counted
                (index.stored if isinstance(event, Stored) else index.removed)(feed.key, event.block_hashes)
            elif isinstance(event, Stored):
                self.index.stored(feed.key, event.block_hashes)
            elif isinstance(event, Removed):
                self.index.removed(feed.key, event.block_hashes)
            else:
                self.index.cleared(feed.key)
        feed.applied = seq
        feed.progress_at = self._clock()
