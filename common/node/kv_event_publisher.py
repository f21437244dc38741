"""A daemon's KV events publisher: the prefix cache's changes, numbered, on a ZMQ PUB socket.

An event's way out:
1. the engine thread's block manager calls :meth:`KVEventPublisher.put` (its ``events`` sink)
   for each block stored or evicted; ``put`` only appends to a bounded queue. A full queue
   drops the event and counts it (``dropped``), and the next batch skips one sequence number,
   so every subscriber sees a gap and asks for a replay;
2. the publisher thread (``pdserve-kv-events``, the only owner of both sockets) takes what is
   queued as soon as something is, as one batch: the next sequence number, vLLM's
   ``[ts, events]`` (``common/kv_events.py``), sent ``[topic, seq, payload(, seal)]``;
3. it keeps recent batches (at most ``buffer_bytes``) for the replay ROUTER: a subscriber that
   missed some asks from a sequence number and gets the batches from there, or, when they are
   no longer all kept, one snapshot batch (cleared + every cached hash, read from the block
   manager) numbered as the last batch sent. Then ``END_SEQ``.

The first batch (sequence 0) says ``AllBlocksCleared``: the cache of a daemon that starts is
empty. Each publisher has a random ``epoch``; the heartbeat carries it with the last sequence
number sent (:meth:`heartbeat`), so the proxy tells a restarted daemon from a gap, and a silent
publisher from one whose batches it lost.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq
from prometheus_client import CollectorRegistry, Gauge

from common.cluster_auth import ClusterKey, kv_events_sealer
from common.engine.cache_events import AllBlocksCleared, CacheEvent
from common.kv_events import (
    END_SEQ,
    MAX_PAYLOAD_BYTES,
    encode_batch,
    encode_event,
    open_frames,
    seal_frames,
    seq_bytes,
    snapshot_batch,
)

logger = logging.getLogger(__name__)
REPLAYS_PER_S = 20  # answered at most (every proxy asks once per gap, restart or start)
SNAPSHOT_MAX_HASHES = 400_000  # the newest; 16-byte hashes keep the batch under MAX_PAYLOAD_BYTES


class KVEventPublisher:
    """Binds a PUB and a replay ROUTER on ``host`` (``port`` and the next one; 0: free ports),
    advertised at ``advertise_host``."""

    def __init__(self, host: str, advertise_host: str, block_size: int, cached_hashes: Callable[[], list[bytes]],
                 key: ClusterKey | None = None, max_queue: int = 10_000, buffer_bytes: int = 8 << 20,
                 idle_s: float = 0.1, topic: bytes = b"", port: int = 0) -> None:
        self.host, self.advertise_host, self.block_size = host, advertise_host, block_size
        self._bind_port = port
        self.epoch = secrets.token_hex(8)
        self.topic = topic
        self.idle_s = idle_s  # the longest a replay request waits for an idle publisher
        self.buffer_bytes = buffer_bytes
        self._cached_hashes = cached_hashes
        self._sealer = kv_events_sealer(key)
        self._queue: queue.Queue[CacheEvent] = queue.Queue(max_queue)
        self._buffer: deque[tuple[int, bytes]] = deque()
        self._buffered = 0
        self._dropped_seen = 0  # ``dropped`` as of the last batch: more since, and the next skips a number
        self.seq = -1  # the last batch sent
        self.dropped = 0
        self.queued = 0  # events put (engine thread) ...
        self.sent = 0  # ... and sent in a batch, or dropped by the queue (publisher thread)
        self.replays = 0
        self.replays_refused = 0
        self._answered: deque[float] = deque(maxlen=REPLAYS_PER_S)  # when the latest replays were answered
        self.snapshots = 0
        self.port = self.replay_port = 0
        self._ctx = zmq.Context()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._pub = self._router = None
        self.put(AllBlocksCleared())

    # ---- engine thread ------------------------------------------------------------------
    def put(self, event: CacheEvent) -> None:
        """Queue ``event``; never blocks (a full queue drops it, and the next batch leaves a gap)."""
        try:
            self._queue.put_nowait(event)
            self.queued += 1
        except queue.Full:
            self.dropped += 1  # written by this thread only; the publisher thread reads it

    # ---- any thread ---------------------------------------------------------------------
    @property
    def pending(self) -> int:
        """Events queued and not yet in a batch sent."""
        return self.queued - self.sent

    @property
    def endpoint(self) -> str:
        return f"{self.advertise_host}:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"{self.advertise_host}:{self.replay_port}"

    def heartbeat(self, root: bytes) -> dict:
        """The heartbeat's keys: ``kv_events`` (``root``: the engine's hash chain root), or none once
        the publisher thread is gone, so the proxies count this node's cache as unknown."""
        if self._thread is None or not self._thread.is_alive():
            return {}
        return {"kv_events": {"endpoint": self.endpoint, "replay": self.replay_endpoint, "epoch": self.epoch,
                              "seq": self.seq, "root": root.hex()}}

    def start(self) -> None:
        """Bind both sockets (here, so a taken port fails the start) and start the thread."""
        self._pub = self._ctx.socket(zmq.PUB)
        self._router = self._ctx.socket(zmq.ROUTER)
        for sock in (self._pub, self._router):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, int(":" in self.host))  # --host :: or another IPv6 address
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        self._router.setsockopt(zmq.MAXMSGSIZE, 4096)  # a replay request is 8 bytes and a seal
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        try:
            if self._bind_port:
                self._pub.bind(f"tcp://{host}:{self._bind_port}")
                self._router.bind(f"tcp://{host}:{self._bind_port + 1}")
                self.port, self.replay_port = self._bind_port, self._bind_port + 1
            else:
                self.port = self._pub.bind_to_random_port(f"tcp://{host}")
                self.replay_port = self._router.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            for sock in (self._pub, self._router):  # or stop()'s term() would wait for them forever
                sock.close(linger=0)
            raise
        self._thread = threading.Thread(target=self._run, name="pdserve-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events on %s (replay %s), epoch %s", self.endpoint, self.replay_endpoint, self.epoch)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            if self._thread.is_alive():
                return  # its sockets are still open: term() would wait for them forever
            self._thread = None
        self._ctx.term()

    # ---- publisher thread ----------------------------------------------------------------
    def _run(self) -> None:
        assert self._pub is not None and self._router is not None
        try:
            while not self._stop.is_set():
                try:  # asleep until an event comes (an idle node wakes 10 times a second: 0.17 % of a core measured, against 1 % polling every 10 ms)
                    first = [self._queue.get(timeout=self.idle_s)]
                except queue.Empty:
                    first = []
                if self._router.poll(0):
                    self._answer_replay()
                self._publish_queued(first)
        except Exception:
            logger.exception("KV events publisher stopped")
        finally:
            self._pub.close(linger=0)
            self._router.close(linger=0)

    def _publish_queued(self, taken: list[CacheEvent] | None = None, limit: int = 10_000) -> None:
        """What is queued (and ``taken`` already), as one batch."""
        events = [encode_event(e) for e in taken or ()]
        while len(events) < limit:
            try:
                events.append(encode_event(self._queue.get_nowait()))
            except queue.Empty:
                break
        dropped = self.dropped
        if not events and dropped == self._dropped_seen:
            return
        if dropped != self._dropped_seen:  # the gap a subscriber notices (the skipped number is never kept)
            self._dropped_seen = dropped
            self.seq += 1
        self.seq += 1
        payload = encode_batch(events)
        seq = seq_bytes(self.seq)
        try:
            self._pub.send_multipart(seal_frames(self._sealer, [self.topic, seq, payload], seq + payload),  # type: ignore[union-attr]
                                     zmq.NOBLOCK)
        except zmq.Again:
            pass  # a subscriber past its high-water mark: it notices the gap
        self._buffer.append((self.seq, payload))
        self.sent += len(events)  # after the number moved on: pending 0 means ``seq`` counts them
        self._buffered += len(payload)
        while self._buffered > self.buffer_bytes and len(self._buffer) > 1:
            self._buffered -= len(self._buffer.popleft()[1])

    def _answer_replay(self) -> None:
        router = self._router
        assert router is not None
        for _ in range(100):
            try:
                frames = router.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            if open_frames(self._sealer, body, 2, slice(1, 2)) is not None or body[0] != b"" or len(body[1]) != 8:
                continue  # not a replay request of this cluster's: no answer
            now = time.monotonic()
            if len(self._answered) == REPLAYS_PER_S and now - self._answered[0] < 1.0:
                self.replays_refused += 1  # a snapshot costs a pass over the cache: asked again at its timeout
                continue
            self._answered.append(now)
            self.replays += 1
            start = int.from_bytes(body[1], "big", signed=True)
            for seq, payload in self._replayed(start):
                self._reply(identity, seq_bytes(seq), payload)
            self._reply(identity, END_SEQ, b"")

    def _replayed(self, start: int) -> list[tuple[int, bytes]]:
        """The batches from ``start`` on, or a snapshot when they are not all kept."""
        self._publish_queued()  # so a snapshot taken now is numbered after everything it includes
        if start > self.seq:
            return []
        kept = [(seq, payload) for seq, payload in self._buffer if seq >= start]
        if kept and kept[0][0] == start:
            return kept
        self.snapshots += 1
        hashes = self._cached_hashes()[-SNAPSHOT_MAX_HASHES:]
        payload = snapshot_batch(hashes, self.block_size)
        assert len(payload) <= MAX_PAYLOAD_BYTES
        return [(self.seq, payload)]

    def _reply(self, identity: bytes, seq: bytes, payload: bytes) -> None:
        try:
            self._router.send_multipart(  # type: ignore[union-attr]
                [identity, *seal_frames(self._sealer, [b"", seq, payload], seq + payload)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the subscriber went: it asks again


def export_metrics(publisher: KVEventPublisher, registry: CollectorRegistry, role: str) -> None:
    """``pdserve:kv_events_seq`` (the last batch's number), ``pdserve:kv_events_dropped`` (events a
    full queue dropped) and ``pdserve:kv_events_pending`` (queued, not yet sent), read at scrape."""
    seq = Gauge("pdserve:kv_events_seq", "Sequence number of the last KV event batch published.", ["role"],
                registry=registry)
    seq.labels(role).set_function(lambda: publisher.seq)
    dropped = Gauge("pdserve:kv_events_dropped", "KV events dropped because the publisher's queue was full.",
                    ["role"], registry=registry)
    dropped.labels(role).set_function(lambda: publisher.dropped)
    pending = Gauge("pdserve:kv_events_pending", "KV events queued and not yet published.", ["role"],
                    registry=registry)
    pending.labels(role).set_function(lambda: publisher.pending)
