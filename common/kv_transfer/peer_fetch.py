"""The peer tier's network half (issue 35; docs/ARCHITECTURE.md, "KV tiers"): a node fetches prefix
blocks it lacks from another daemon of the cluster that holds them, and serves its own.

Both go over the KV endpoint's control plane: the ROUTER every daemon binds, messages sealed
under the cluster key, so only members ask and only members answer. A fetch is not a request's
transfer: no pair, no record in the producer's or consumer's table.

Serving (:class:`PeerServer`): a :class:`FetchBlocks` goes to ``serve`` (the engine's, run on its
thread between two steps), which copies the KV of the leading asked blocks its pool holds out at
once; the copy is the answer. When those fall short of the ask, ``serve_rest`` (the file tier's,
when the node has one) reads the blocks after them on the server's own reader thread, never the
engine's: pool, then host tier, then files, each run after the one before. Nothing stays held for
the asker, so a fetch that is lost, aborted or never read leaves nothing behind on this node. At
most ``MAX_SERVING`` answers are being made at once; more are told busy (the asker computes
instead).

Fetching (:class:`PeerFetcher`): ``load(job, kv_addr, hashes)`` asks for the blocks a chunk at a
time (at most ``CHUNK_BYTES`` of KV per answer), in order. A chunk's blocks count only when the
answer's count, bytes and each block's CRC-32 check out; a chunk that fails, times out or comes
back short ends the job with the blocks landed before it (0 or more leading blocks: never a block
half there). The engine thread takes finished jobs (:meth:`PeerFetcher.take_loaded`) and copies
them into its pool (common/engine/kv_tiers.py).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from common.kv_transfer.control import ControlPlane
from common.kv_transfer.messages import Blocks, Error, FetchBlocks, Message

logger = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20  # the most KV one answer carries
MAX_FETCH_BLOCKS = 256  # the most blocks one FetchBlocks may name
MAX_SERVING = 4  # answers being made at once (each costs the engine thread a copy)
MAX_HASH_BYTES = 64
BUSY = "busy: too many peer fetches being served"
# serve(hashes) -> future of (count, data): the KV of the leading ``count`` blocks held, back to back
ServeBlocks = Callable[[list[bytes]], "Future[tuple[int, bytes]]"]
ServeRest = Callable[[list[bytes]], tuple[int, bytes]]  # the leading blocks of these it holds, and their KV


def block_checksums(data: bytes | memoryview, count: int, block_bytes: int) -> list[int]:
    view = memoryview(data)
    return [zlib.crc32(view[i * block_bytes:(i + 1) * block_bytes]) for i in range(count)]


class PeerServer:
    """Answers the FetchBlocks that reach this endpoint's ROUTER (``handle``, on the I/O thread)."""

    def __init__(self, control: ControlPlane, fingerprint: str, block_bytes: int) -> None:
        self.control, self.fingerprint, self.block_bytes = control, fingerprint, block_bytes
        self.serve: ServeBlocks | None = None  # set when the node runs --kv-peer-fetch on
        self.serve_rest: ServeRest | None = None  # then the blocks after those (the file tier), read off the engine thread
        self._reads: queue.SimpleQueue | None = None  # the reader thread's work, once it runs
        self._serving = 0
        self._lock = threading.Lock()
        self.served_blocks = 0
        self.refused = 0

    def handle(self, identity: bytes, msg: FetchBlocks) -> None:
        why = self._refusal(msg)
        if why is not None:
            self.refused += 1
            self.control.reply(identity, Error(id=msg.id, reason=why))
            return
        with self._lock:
            self._serving += 1
        try:
            future = self.serve(list(msg.hashes))  # type: ignore[misc]
        except Exception as e:  # noqa: BLE001 - the engine is gone or stopping: say so, keep listening
            self._answered(identity, msg, None, e)
            return
        future.add_done_callback(lambda f: self._answered(identity, msg, f, None))

    def _refusal(self, msg: FetchBlocks) -> str | None:
        if self.serve is None:
            return "this node does not serve peer fetches (--kv-peer-fetch off)"
        if msg.fingerprint != self.fingerprint:
            return f"KV layout {msg.fingerprint[:64]!r} is not this node's ({self.fingerprint})"
        hashes = msg.hashes
        if not 1 <= len(hashes) <= MAX_FETCH_BLOCKS or not all(
                isinstance(h, bytes) and 1 <= len(h) <= MAX_HASH_BYTES for h in hashes):
            return f"hashes: 1 to {MAX_FETCH_BLOCKS} block hashes of at most {MAX_HASH_BYTES} bytes"
        if len(hashes) * self.block_bytes > CHUNK_BYTES and len(hashes) > 1:
            return f"asked more than {CHUNK_BYTES} bytes of KV in one fetch"
        with self._lock:
            if self._serving >= MAX_SERVING:
                return BUSY
        return None

    def _answered(self, identity: bytes, msg: FetchBlocks, future: Future | None, error: Exception | None) -> None:
        """The engine's part is done (or failed): answer, or first read the rest on the reader thread."""
        count, data = 0, b""
        if future is not None:
            error = future.exception()
            if error is None:
                count, data = future.result()
                if count < len(msg.hashes) and self.serve_rest is not None:
                    self._reader().put((identity, msg, count, data))
                    return
        self._reply(identity, msg, count, data, error)

    def _reader(self) -> queue.SimpleQueue:
        with self._lock:
            if self._reads is None:
                self._reads = queue.SimpleQueue()
                # a daemon thread: a read hung on a dead volume must not hold the process at exit
                threading.Thread(target=self._read_loop, args=(self._reads,), name="peer-serve-reader",
                                 daemon=True).start()
            return self._reads

    def close(self) -> None:
        """Stop the reader thread once it has answered what it holds (a read hung on a dead volume
        keeps it, a daemon thread, until the read returns)."""
        with self._lock:
            if self._reads is not None:
                self._reads.put(None)
                self._reads = None

    def _read_loop(self, reads: queue.SimpleQueue) -> None:
        while (item := reads.get()) is not None:
            identity, msg, count, data = item
            try:
                more, extra = self.serve_rest(list(msg.hashes[count:]))  # type: ignore[misc]
            except Exception as e:  # noqa: BLE001 - the blocks in hand still go; the reader goes on
                logger.warning("peer fetch: reading %d block(s) after the %d held failed: %r",
                               len(msg.hashes) - count, count, e)
                more, extra = 0, b""
            self._reply(identity, msg, count + more, data + extra, None)

    def _reply(self, identity: bytes, msg: FetchBlocks, count: int, data: bytes, error: Exception | None) -> None:
        with self._lock:
            self._serving -= 1
        if error is not None:
            logger.warning("peer fetch: serving %d block(s) failed: %r", len(msg.hashes), error)
            self.control.reply(identity, Error(id=msg.id, reason=f"serving failed: {error!r}"[:200]))
            return
        self.served_blocks += count
        self.control.reply(identity, Blocks(id=msg.id, count=count, data=data,
                                            checksums=block_checksums(data, count, self.block_bytes)))


@dataclass
class _Fetch:
    job: str
    kv_addr: str
    hashes: list[bytes]
    landed: list[torch.Tensor] = field(default_factory=list)


class PeerFetcher:
    """Fetches blocks from peers for the engine's KV tiers: ``load`` and ``cancel`` from the engine
    thread, the asking on the endpoint's I/O thread, ``take_loaded`` back on the engine thread."""

    def __init__(self, control: ControlPlane, fingerprint: str, block_shape: tuple[int, ...], dtype: torch.dtype,
                 timeout_s: float, on_news: Callable[[], None] = lambda: None) -> None:
        self.control, self.fingerprint = control, fingerprint
        self.block_shape, self.dtype, self.timeout_s = block_shape, dtype, timeout_s
        self.block_bytes = math.prod(block_shape) * dtype.itemsize
        self.chunk = max(1, min(MAX_FETCH_BLOCKS, CHUNK_BYTES // self.block_bytes))
        self.on_news = on_news
        self._lock = threading.Lock()
        self._jobs: dict[str, _Fetch] = {}
        self._done: list[tuple[str, list[torch.Tensor]]] = []
        self.failures = 0  # fetches that ended before every block asked landed (a miss, an error, a timeout)

    @property
    def has_news(self) -> bool:
        return bool(self._done)

    @property
    def pending(self) -> int:
        """Jobs asked and not yet taken or cancelled (0 when idle: nothing leaks)."""
        with self._lock:
            return len(self._jobs) + len(self._done)

    def load(self, job: str, kv_addr: str, hashes: list[bytes]) -> None:
        fetch = _Fetch(job, kv_addr, list(hashes))
        with self._lock:
            self._jobs[job] = fetch
        self.control.call_soon(lambda: self._ask(fetch))

    def cancel(self, job: str) -> None:
        """Forget ``job``: what its peer answers later is dropped."""
        with self._lock:
            self._jobs.pop(job, None)
            self._done = [(j, t) for j, t in self._done if j != job]

    def take_loaded(self) -> list[tuple[str, list[torch.Tensor]]]:
        """Finished jobs: the leading blocks that landed whole, one ``[*block_shape]`` tensor each."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def _ask(self, fetch: _Fetch) -> None:
        with self._lock:
            if self._jobs.get(fetch.job) is not fetch:
                return  # cancelled
        chunk = fetch.hashes[len(fetch.landed):len(fetch.landed) + self.chunk]
        msg = FetchBlocks(hashes=chunk, fingerprint=self.fingerprint)
        future = self.control.request(fetch.kv_addr, msg, self.timeout_s)
        future.add_done_callback(lambda f: self.control.call_soon(lambda: self._answer(fetch, len(chunk), f)))

    def _answer(self, fetch: _Fetch, asked: int, future: Future) -> None:
        error = future.exception()
        reply: Message | None = None if error is not None else future.result()
        got = self._blocks(reply, asked) if isinstance(reply, Blocks) else []
        fetch.landed.extend(got)
        if len(got) == asked and len(fetch.landed) < len(fetch.hashes):
            self._ask(fetch)
            return
        if len(fetch.landed) < len(fetch.hashes):
            self.failures += 1
            why = reply.reason if isinstance(reply, Error) else (repr(error) if error is not None else
                                                                 f"{len(got)} of {asked} block(s) held")
            logger.info("peer fetch from %s: %d of %d block(s) landed (%s); the rest is computed",
                        fetch.kv_addr, len(fetch.landed), len(fetch.hashes), why)
        with self._lock:
            if self._jobs.pop(fetch.job, None) is not fetch:
                return  # cancelled meanwhile
            self._done.append((fetch.job, fetch.landed))
        self.on_news()

    def _blocks(self, reply: Blocks, asked: int) -> list[torch.Tensor]:
        """The answer's blocks that check out, leading ones only; [] when the answer itself does not."""
        count, data = reply.count, reply.data
        if not 0 <= count <= asked or len(data) != count * self.block_bytes or len(reply.checksums) != count:
            logger.warning("peer fetch: dropped an answer of %d byte(s) for %d block(s) (asked %d)",
                           len(data), count, asked)
            return []
        good = 0
        for crc, want in zip(block_checksums(data, count, self.block_bytes), reply.checksums):
            if crc != want:
                logger.warning("peer fetch: block %d of an answer failed its checksum; it and what follows "
                               "are computed", good)
                break
            good += 1
        if not good:
            return []
        kv = torch.frombuffer(bytearray(data[:good * self.block_bytes]), dtype=self.dtype)
        return list(kv.view(good, *self.block_shape).unbind(0))
