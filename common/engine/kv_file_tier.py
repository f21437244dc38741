"""The file tier of the KV cache: evicted prefix blocks kept as files in a directory.

A block's life here:
1. the engine thread hands :meth:`FileTier.put` a host copy of the block's KV (every layer's K
   and V, ``[num_layers, 2, block_size, num_kv_heads, head_dim]``); ``put`` only queues it (a
   bounded queue: when full, the store is dropped and counted in ``dropped``);
2. the writer thread (``pdserve-kv-disk-write``) writes it to a temporary name and renames it to
   ``<dir>/<namespace>/<block hash>.kv``: a reader sees the whole file or none, so a half-written
   file (a crash, a full disk) is never read; one a power loss cut short (no fsync: a cache) fails
   its length and CRC-32 check on load and is recomputed. The namespace is a digest of the model
   and the KV layout (the hash chain's root), so nodes of the same model share one directory;
3. past ``max_bytes`` the least recently stored or loaded files this node knows of are deleted
   (LRU by bytes: the next turn of a conversation reuses its newest blocks);
4. :meth:`load` queues a job (a request's next blocks, in chain order); the loader thread
   (``pdserve-kv-disk-load``) reads them in order, checks each file's checksum and shape, and
   stops at the first that is missing or bad. The engine thread takes the finished jobs with
   :meth:`take_loaded` and copies the tensors into the request's blocks: no thread but the
   engine's ever writes the KV cache.

Every fault (no directory, unwritable, full disk, a corrupted or vanished file, an I/O error) is
counted in ``load_errors`` / ``store_errors`` and logged as a warning; it costs recompute, never
an answer. Counters have one writer each (the thread named beside them).
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable
from pathlib import Path

import msgpack
import torch

logger = logging.getLogger(__name__)

MAGIC = b"PDKV1\n"
_HEADER_LEN = struct.Struct("<I")
WRITE_QUEUE_BYTES = 256 << 20  # stores queued for the writer (at least 256 blocks); more are dropped
# (the engine never waits on a disk; a finished long prompt under --kv-offload-on-finish queues all its blocks)
SUFFIX = ".kv"
WARN_EVERY_S = 10.0


class BadBlockFile(ValueError):
    """A block file that is not whole: wrong magic, header, size, shape or checksum."""


def encode_block(kv: torch.Tensor) -> bytes:
    """``kv`` (a contiguous host tensor) as the file's bytes: magic, header (shape, dtype, the
    payload's length and CRC-32), payload. A CRC finds damage (2 GB/s here, against 1.2 for
    blake2b); the file's name, a blake2b chain hash, is what says which KV it is."""
    payload = kv.contiguous().view(torch.uint8).numpy().tobytes()
    header = msgpack.packb({"shape": list(kv.shape), "dtype": str(kv.dtype).removeprefix("torch."),
                            "len": len(payload), "crc32": zlib.crc32(payload)})
    return MAGIC + _HEADER_LEN.pack(len(header)) + header + payload


def decode_block(data: bytes | bytearray, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The tensor ``data`` holds (a view of it when ``data`` is a bytearray: no copy); BadBlockFile
    unless it is whole and of ``shape`` and ``dtype``."""
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + _HEADER_LEN.size:
        raise BadBlockFile("not a KV block file")
    start = len(MAGIC) + _HEADER_LEN.size
    (header_len,) = _HEADER_LEN.unpack_from(data, len(MAGIC))
    try:
        header = msgpack.unpackb(data[start:start + header_len])
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
        raise BadBlockFile(f"header unreadable ({type(exc).__name__})") from None
    payload = memoryview(data)[start + header_len:]
    if not isinstance(header, dict) or header.get("len") != len(payload):
        raise BadBlockFile(f"payload of {len(payload)} bytes, header says {header.get('len') if isinstance(header, dict) else '?'}")
    if tuple(header.get("shape", ())) != tuple(shape) or header.get("dtype") != str(dtype).removeprefix("torch."):
        raise BadBlockFile(f"shape {header.get('shape')} {header.get('dtype')}, expected {list(shape)} {dtype}")
    if zlib.crc32(payload) != header.get("crc32"):
        raise BadBlockFile("checksum mismatch")
    if not isinstance(data, bytearray):
        data = bytearray(data)
    return torch.frombuffer(data, dtype=dtype, offset=start + header_len).view(shape)


class FileTier:
    """Blocks as files under ``directory/namespace``, at most ``max_bytes`` of them known to this node.

    ``on_news``: called from the loader or writer thread when a job finished or a file was written or
    deleted (wakes the engine thread: a request can run, KV events are to be sent)."""

    def __init__(self, directory: str, namespace: str, max_bytes: int, block_shape: tuple[int, ...],
                 dtype: torch.dtype, on_news: Callable[[], None] = lambda: None) -> None:
        self.dir = Path(directory) / namespace
        self.max_bytes = max_bytes
        self.block_shape, self.dtype = tuple(block_shape), dtype
        self.on_news = on_news
        self.enabled = False
        self._files: OrderedDict[bytes, int] = OrderedDict()  # hash -> file size, least recent first
        self._lock = threading.Lock()  # guards _files (writer, loader and engine threads)
        block_bytes = torch.empty(block_shape, dtype=dtype, device="meta").nbytes
        self._writes: queue.Queue[tuple[bytes, torch.Tensor, object] | None] = queue.Queue(
            max(256, WRITE_QUEUE_BYTES // max(block_bytes, 1)))
        self._loads: queue.Queue[tuple[str, list[bytes]] | None] = queue.Queue()
        self._loaded: deque[tuple[str, list[torch.Tensor]]] = deque()
        self._cancelled: set[str] = set()  # jobs the engine no longer wants (engine adds, loader discards)
        self._queued: dict[bytes, torch.Tensor] = {}  # stores not yet written (engine adds, writer removes)
        self._changes: deque[tuple[bool, bytes]] = deque()  # (stored?, hash): for the KV events
        self._tmp_ids = itertools.count()
        self._warned: dict[str, tuple[float, int]] = {}  # kind -> (when last logged, not logged since); one writer per kind
        self._threads: list[threading.Thread] = []
        self.bytes = 0  # writer / loader threads, under the lock
        self.dropped = 0  # engine thread
        self.blocks_read = self.load_errors = 0  # loader thread (load_errors: the peer reader's too)
        self.blocks_served = 0  # read for peers (read_run)
        self.load_seconds = self.loaded_bytes = 0.0  # loader thread
        self.stores = self.store_errors = 0  # writer thread
        self.store_seconds = 0.0  # writer thread

    # ---- start / stop ----------------------------------------------------------------------
    def start(self) -> bool:
        """Make the directory, prove it writable, index what is there, start the threads. An
        unusable directory leaves the tier off with a warning (the node serves without it)."""
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe.{os.getpid()}.tmp"
            with open(probe, "wb") as f:
                f.write(b"x")
                os.fsync(f.fileno())
            probe.unlink()
            self._index_existing()
        except OSError as exc:
            self.store_errors += 1
            logger.warning("KV file tier off: %s is not usable (%s); prefixes evicted from the KV cache "
                           "will be recomputed", self.dir, exc)
            return False
        self.enabled = True
        for name, target in (("pdserve-kv-disk-write", self._write_loop), ("pdserve-kv-disk-load", self._load_loop)):
            thread = threading.Thread(target=target, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        logger.info("KV file tier at %s: %d blocks (%.1f MiB) already there, bound %.1f MiB", self.dir,
                    len(self._files), self.bytes / 2**20, self.max_bytes / 2**20)
        return True

    def _index_existing(self) -> None:
        """Seed the LRU with the files already there (another node's, or ours before a restart), oldest first."""
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(SUFFIX) and not entry.name.startswith("."):
                try:
                    st = entry.stat()
                    found.append((st.st_mtime, bytes.fromhex(entry.name[:-len(SUFFIX)]), st.st_size))
                except (OSError, ValueError):
                    continue
        with self._lock:
            for _, block_hash, size in sorted(found):
                self._files[block_hash] = size
                self.bytes += size
        self._trim()

    def drain(self, timeout: float) -> bool:
        """Wait until every queued store is written (or failed); False if ``timeout`` s passed first."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.002)
        return not self._writes.unfinished_tasks

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads (queued stores are written first, within ``timeout``)."""
        if not self.enabled:
            return
        self.enabled = False
        for q in (self._writes, self._loads):
            try:
                q.put(None, timeout=timeout)
            except queue.Full:
                logger.warning("KV file tier: the writer did not drain its queue in %.0f s; stopping without it", timeout)
        for thread in self._threads:
            thread.join(timeout)

    # ---- engine thread -----------------------------------------------------------------------
    def knows(self, block_hash: bytes) -> bool:
        """This node stored, queued or loaded the block (no disk access)."""
        return block_hash in self._files or block_hash in self._queued

    def contains(self, block_hash: bytes) -> bool:
        """A file for the block exists (one stat: another node sharing the directory may have written it)."""
        return self.enabled and (block_hash in self._files or self._path(block_hash).exists())

    def put(self, block_hash: bytes, kv: torch.Tensor, ready: object = None) -> None:
        """Queue ``kv`` (a host tensor no one writes again) for writing; ``ready``: a CUDA event the
        writer waits on before it reads ``kv`` (a device-to-host copy still running)."""
        if not self.enabled:
            return
        try:
            self._writes.put_nowait((block_hash, kv, ready))
        except queue.Full:
            self.dropped += 1
            return
        self._queued[block_hash] = kv

    def queued(self, block_hash: bytes) -> torch.Tensor | None:
        """The KV of a block on its way to a file (queued, not yet written), or None: a lookup takes
        it from memory, as a block in transit from the host tier is in neither tier's index yet."""
        return self._queued.get(block_hash)

    def load(self, job: str, hashes: list[bytes]) -> None:
        """Read ``hashes`` in order (job ``job``); :meth:`take_loaded` gives what was read."""
        self._loads.put((job, list(hashes)))

    def cancel(self, job: str) -> None:
        """Do not read ``job``'s blocks if not started yet; its result, if any, is dropped."""
        self._cancelled.add(job)

    def take_loaded(self) -> list[tuple[str, list[torch.Tensor]]]:
        """Finished jobs: each job's tensors, the leading blocks read whole (maybe none)."""
        out = []
        while self._loaded:
            job, tensors = self._loaded.popleft()
            if job in self._cancelled:
                self._cancelled.discard(job)
            else:
                out.append((job, tensors))
        return out

    def take_changes(self) -> list[tuple[bool, bytes]]:
        """Files written (True) or deleted (False) since the last call, for the KV events."""
        out = []
        while self._changes:
            out.append(self._changes.popleft())
        return out

    @property
    def has_news(self) -> bool:
        """Finished loads or file changes wait for the engine thread."""
        return bool(self._loaded or self._changes)

    @property
    def blocks(self) -> int:
        return len(self._files)

    @property
    def pending_loads(self) -> int:
        return self._loads.qsize()

    def _warn(self, kind: str, message: str, *args: object) -> None:
        """A warning, at most one per WARN_EVERY_S of each kind (a full disk fails every store):
        the next one says how many were not logged."""
        now = time.monotonic()
        last, quiet = self._warned.get(kind, (-WARN_EVERY_S, 0))
        if now - last < WARN_EVERY_S:
            self._warned[kind] = (last, quiet + 1)
            return
        self._warned[kind] = (now, 0)
        logger.warning(message + (f" ({quiet} more since the last such warning)" if quiet else ""), *args)

    # ---- any thread ----------------------------------------------------------------------------
    def read_run(self, hashes: list[bytes]) -> tuple[int, bytes]:
        """What the peer tier serves from files (after the pool and the host tier): how many leading
        ``hashes`` have a whole file here (CRC checked), and their KV back to back. Runs on the peer
        server's reader thread; a bad file is handled as a load's (warned, deleted, forgotten)."""
        parts = []
        for block_hash in hashes:
            kv = self._read(block_hash) if self.contains(block_hash) else None
            if kv is None:
                break
            parts.append(kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        self.blocks_served += len(parts)
        return len(parts), b"".join(parts)

    # ---- writer thread -----------------------------------------------------------------------
    def _path(self, block_hash: bytes) -> Path:
        return self.dir / (block_hash.hex() + SUFFIX)

    def _write_loop(self) -> None:
        while (item := self._writes.get()) is not None:
            try:
                self._store(*item)
            finally:
                if self._queued.get(item[0]) is item[1]:
                    del self._queued[item[0]]
                self._writes.task_done()

    def _store(self, block_hash: bytes, kv: torch.Tensor, ready: object) -> None:
        started = time.perf_counter()
        try:
            if ready is not None:
                ready.synchronize()  # type: ignore[attr-defined]
            size = self._write(block_hash, encode_block(kv))
        except Exception as exc:  # noqa: BLE001 - I/O or a CUDA error: this block is lost, the writer goes on
            self.store_errors += 1
            self._warn("store", "KV file tier: could not store a block in %s (%s); it will be recomputed", self.dir, exc)
            return
        self.store_seconds += time.perf_counter() - started
        self.stores += 1
        with self._lock:
            if block_hash in self._files:
                self.bytes -= self._files.pop(block_hash)
            self._files[block_hash] = size
            self.bytes += size
        self._changes.append((True, block_hash))
        self._trim()
        self.on_news()

    def _write(self, block_hash: bytes, data: bytes) -> int:
        """Write-then-rename: the final name appears only with every byte written, so no process ever
        reads a file half-written. No fsync: a cache need not outlive a power loss, and a file that
        one cut short fails its length and CRC-32 check on load (deleted, recomputed); an fsync
        per block cost ~100 us of CPU and ~250 us of wall here, beside the node's steps."""
        path = self._path(block_hash)
        tmp = self.dir / f".{path.name}.{os.getpid()}.{next(self._tmp_ids)}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        return len(data)

    def _trim(self) -> None:
        """Delete the least recent files until this node's known bytes fit ``max_bytes``."""
        while True:
            with self._lock:
                if self.bytes <= self.max_bytes or not self._files:
                    return
                block_hash, size = self._files.popitem(last=False)
                self.bytes -= size
            self._path(block_hash).unlink(missing_ok=True)
            self._changes.append((False, block_hash))

    # ---- loader thread -----------------------------------------------------------------------
    def _load_loop(self) -> None:
        while (item := self._loads.get()) is not None:
            job, hashes = item
            if job in self._cancelled:
                self._cancelled.discard(job)
                continue
            started = time.perf_counter()
            tensors: list[torch.Tensor] = []
            try:
                for block_hash in hashes:
                    kv = self._read(block_hash)
                    if kv is None:
                        break
                    tensors.append(kv)
            except Exception as exc:  # noqa: BLE001 - whatever it was, the blocks read so far stand and the loader goes on
                self.load_errors += 1
                self._warn("load", "KV file tier: a load failed (%r); recomputing from there", exc)
            self.blocks_read += len(tensors)
            self.load_seconds += time.perf_counter() - started
            self._loaded.append((job, tensors))
            self.on_news()

    def _read(self, block_hash: bytes) -> torch.Tensor | None:
        path = self._path(block_hash)
        try:
            with open(path, "rb") as f:
                data = bytearray(os.fstat(f.fileno()).st_size)
                if f.readinto(data) != len(data):
                    raise BadBlockFile("file shorter than its size")
            kv = decode_block(data, self.block_shape, self.dtype)
        except (OSError, BadBlockFile) as exc:
            self.load_errors += 1
            self._warn("load", "KV file tier: %s unusable (%s); recomputing from there", path.name, exc)
            if isinstance(exc, BadBlockFile):
                path.unlink(missing_ok=True)  # a damaged file is never asked for again
            with self._lock:
                size = self._files.pop(block_hash, None)
                if size is not None:
                    self.bytes -= size
            if size is not None:
                self._changes.append((False, block_hash))
            return None
        self.loaded_bytes += len(data)
        with self._lock:
            if block_hash in self._files:
                self._files.move_to_end(block_hash)
            else:  # another node's file: ours to bound from now on too
                self._files[block_hash] = len(data)
                self.bytes += len(data)
        return kv
