"""KV tiers behind the prefix cache: where a cached block goes when the KV pool evicts it, and how
it comes back (issue 35; docs/ARCHITECTURE.md, "KV tiers").

Down: the block manager calls :meth:`KVTiers.offload_many` with the cached blocks an allocation
evicts, before they are handed out again (and the scheduler does for a finished prompt's blocks
under ``--kv-offload-on-finish``). Their KV, every layer's K and V, is gathered on the pool's
device and copied off at once (on CUDA into pinned host memory, queued on the compute stream so it
precedes any later write to the blocks) into the host tier (``--kv-host-bytes``: one slab of block
slots, allocated at start, an LRU) or, without one, straight to the file tier's writer
(``kv_file_tier``). A block the host tier evicts goes down to the file tier.

Up: a request whose prefix misses the pool asks :meth:`lookup` for its next blocks, in chain order,
each from the highest tier holding it, up to the first no tier holds. The scheduler allocates fresh
blocks for them and calls :meth:`start_load`: host-tier blocks are copied in at once (memory to
memory); file-tier blocks are read by the loader thread while the request waits in the scheduler
(``loading``); :meth:`poll` (the engine thread, each schedule) copies what was read into the
blocks and says how many leading blocks each finished load filled. A block after the first one
that failed (missing, damaged, an I/O error) is never used: the scheduler frees it and computes
those tokens. :meth:`cancel` (an abort) forgets a load; whatever the loader then reads is dropped.

Peer: with ``--kv-peer-fetch on`` a request may carry a hint from the proxy (another daemon holds
more of its prefix in its pool). The blocks after what the pool, host and file tiers hold, up to
the hint's count, are asked of that peer (``peer``, the KV endpoint's ``PeerFetcher``,
common/kv_transfer/peer_fetch.py) while the request waits in ``loading`` as for a file load; only
the leading blocks that landed verified are used.

A file or peer load is taken only while it pays: its measured wall time per block (asked to polled, an
EWMA) below the engine's measured prefill time for a block's tokens; a load slower than recompute
would only add to the request's TTFT. One lookup in ``EXPLORE_EVERY`` loads anyway, to measure
again (``--kv-tier-load always``: every time). The same rate, as bytes/s, goes to the proxy in heartbeats.

Only the engine thread calls this class; the file tier's threads and the peer fetcher never touch
the KV pool.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import islice
from typing import Protocol

import torch

from common.engine.cache_events import BlockRemoved, BlockStored, CacheEvent
from common.engine.kv_file_tier import FileTier
from common.kv_layout import block_major

logger = logging.getLogger(__name__)

MEDIUM_HOST = "CPU"  # vLLM's name for its CPU offload tier, in KV events' ``medium``
MEDIUM_DISK = "DISK"
MEDIUM_PEER = "PEER"  # another daemon's pool (the peer tier); in heartbeats' load rates, never in KV events
LOAD_TIMEOUT_S = 10.0  # a file load not done by then (a hung volume) is given up: its request computes instead
EXPLORE_EVERY = 16  # a file tier measured slower than prefill is still tried once in this many lookups
_EWMA = 0.2


class PeerSource(Protocol):
    """What the peer tier needs of the KV endpoint (common/kv_transfer/peer_fetch.py's PeerFetcher):
    an asynchronous fetch of blocks by hash whose result is the leading blocks that landed whole."""

    has_news: bool

    def load(self, job: str, kv_addr: str, hashes: list[bytes]) -> None: ...

    def cancel(self, job: str) -> None: ...

    def take_loaded(self) -> list[tuple[str, list[torch.Tensor]]]: ...


class HostTier:
    """Blocks' KV in one host slab of ``max_bytes // block_bytes`` slots (pinned on CUDA), allocated
    once, least recently used out first. Copies go in and out by runs of adjacent slots, one copy
    per run: no allocation and no copy per block (issue 35: a pinned allocation and a copy per block
    ran at 0.06x a pinned ``copy_`` on an H200)."""

    def __init__(self, max_bytes: int, block_shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> None:
        self.max_bytes = max_bytes
        self.block_bytes = math.prod(block_shape) * dtype.itemsize
        self.capacity = max_bytes // self.block_bytes
        self.slab = torch.empty((self.capacity, *block_shape), dtype=dtype, pin_memory=pin)
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # hash -> slot, oldest first
        # never filled yet, ascending (an evicted slot is filled again at once, never freed): taken from
        # the front, so one offload's slots make one run
        self._free = list(range(self.capacity))
        self._ready: list[object] = [None] * self.capacity  # the event after the copy that filled each slot
        self.leased: set[int] = set()  # slots a lookup handed out and no load has copied yet: not reused
        self.hits = self.served = 0  # served: blocks copied out for peers' fetches
        self.load_seconds = self.store_seconds = self.loaded_bytes = 0.0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._slots

    @property
    def blocks(self) -> int:
        return len(self._slots)

    @property
    def bytes(self) -> int:
        return len(self._slots) * self.block_bytes

    def claim(self, n: int) -> tuple[list[int], list[tuple[bytes, int]]]:
        """Up to ``n`` slots to fill, lowest first, and the (hash, slot) pairs evicted for them, oldest
        first; an evicted slot keeps its bytes until it is filled (:meth:`read` them before)."""
        slots = self._free[:n]
        del self._free[:n]
        evicted = []
        if len(slots) < n:
            oldest = (h for h, slot in self._slots.items() if slot not in self.leased)
            for old_hash in list(islice(oldest, n - len(slots))):
                evicted.append((old_hash, self._slots.pop(old_hash)))
            slots += [slot for _, slot in evicted]
        return sorted(slots), evicted

    def read(self, slot: int) -> torch.Tensor:
        """A copy of ``slot``'s bytes in ordinary memory, once they are there."""
        ready = self._ready[slot]
        if ready is not None:
            ready.synchronize()  # type: ignore[attr-defined]
        return self.slab[slot].clone()

    def fill(self, hashes: list[bytes], slots: list[int], kv: torch.Tensor) -> None:
        """Copy ``kv`` (``[n, *block_shape]``, contiguous) into ``slots`` (ascending, from :meth:`claim`)
        and keep them as ``hashes``; on CUDA queued on the current stream, with an event after."""
        for start, stop in runs(slots):
            self.slab[slots[start]:slots[start] + stop - start].copy_(kv[start:stop], non_blocking=True)
        ready = None
        if kv.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        for block_hash, slot in zip(hashes, slots):
            self._slots[block_hash] = slot
            self._ready[slot] = ready

    def copy_of(self, block_hash: bytes) -> torch.Tensor:
        """A copy of ``block_hash``'s KV in ordinary memory (for a peer: not a hit of this node's)."""
        return self.read(self._slots[block_hash])

    def get(self, block_hash: bytes) -> int:
        """The slot holding ``block_hash``, now the most recently used."""
        self._slots.move_to_end(block_hash)
        self.hits += 1
        self.loaded_bytes += self.block_bytes
        return self._slots[block_hash]


def runs(slots: list[int | None]) -> list[tuple[int, int]]:
    """``[start, stop)`` index ranges of ``slots`` whose values go up by one; a None stands alone."""
    out, start = [], 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] is None or slots[i - 1] is None or slots[i] != slots[i - 1] + 1:
            out.append((start, i))
            start = i
    return out


@dataclass
class Found:
    """What :meth:`KVTiers.lookup` found: each leading block's tier and where its KV is: a host-tier
    slot, a tensor (queued for the file tier's writer), or None (to be read from its file)."""

    mediums: list[str]
    kv: list[torch.Tensor | int | None]
    peer: str | None = None  # the KV address the PEER blocks come from

    def __len__(self) -> int:
        return len(self.mediums)


@dataclass
class _Load:
    """One request's load: its blocks, which tier each comes from, and its parts still read elsewhere."""

    blocks: list[int]
    mediums: list[str]
    parts: dict[str, list[int]] = field(default_factory=dict)  # DISK / PEER -> indices of ``blocks`` it fills
    landed: dict[str, int] = field(default_factory=dict)  # of a finished part: its leading positions filled
    started: float = 0.0  # time.monotonic() when the file tier or the peer was asked

    def cut(self) -> int:
        """The leading blocks filled, as far as the parts tell: up to the first position of a part
        that has not landed (an unfinished part: none of it)."""
        return min((positions[self.landed.get(medium, 0)] for medium, positions in self.parts.items()
                    if self.landed.get(medium, 0) < len(positions)), default=len(self.blocks))


class KVTiers:
    """The host and file tiers of one engine's KV pool (either may be off)."""

    def __init__(self, kv_caches: list[torch.Tensor], host_bytes: int, file_tier: FileTier | None,
                 offload_on_finish: bool = False, always_load: bool = False) -> None:
        self.kv_caches = kv_caches
        self.device = kv_caches[0].device
        self.block_shape = (len(kv_caches), *kv_caches[0][:, 0].shape)
        self.block_bytes = sum(cache[:, 0].nbytes for cache in kv_caches)
        self.pool_blocks = block_major(kv_caches)  # the whole pool block by block, where its layers allow
        self.prefill_tokens_per_s: Callable[[], float | None] = lambda: None  # the engine's measure
        # EWMA of a load's wall time (asked to polled) per block, by medium (DISK, PEER)
        self.s_per_block: dict[str, float | None] = {MEDIUM_DISK: None, MEDIUM_PEER: None}
        self.peer: PeerSource | None = None  # the peer tier, once the daemon's KV endpoint lends one
        self._lookups = 0
        self.host = HostTier(host_bytes, self.block_shape, kv_caches[0].dtype, self.device.type == "cuda") \
            if host_bytes > 0 else None
        # on CUDA the host tier's copies run on a stream of their own: the steps queued meanwhile do
        # not wait behind an eviction's device-to-host copy (issue 35: off the step's critical path)
        self.copy_stream = torch.cuda.Stream(self.device) if self.host is not None and self.device.type == "cuda" \
            else None
        self.file = file_tier
        self.offload_on_finish = offload_on_finish
        self.always_load = always_load  # --kv-tier-load always: no measured choice
        self._loads: dict[str, _Load] = {}
        self._events: list[CacheEvent] = []
        self.queried = {MEDIUM_HOST: 0, MEDIUM_DISK: 0, MEDIUM_PEER: 0}  # blocks asked of each tier
        self.found = {MEDIUM_HOST: 0, MEDIUM_DISK: 0, MEDIUM_PEER: 0}  # of those, blocks it had (a peer: landed)
        self.lost = 0  # blocks a load could not fill (recomputed)
        self.timeouts = 0  # file loads given up (LOAD_TIMEOUT_S)
        self.disk_hits = 0  # file-tier blocks copied into the pool for a request (read for a cancelled one: not)
        self.peer_seconds = 0.0  # peer loads' wall time, asked to polled
        self.peer_errors = 0  # peer loads that landed fewer blocks than asked

    @property
    def enabled(self) -> bool:
        return self.host is not None or (self.file is not None and self.file.enabled) or self.peer is not None

    @property
    def has_news(self) -> bool:
        """Something for :meth:`poll`: a finished load, or tier changes for the KV events."""
        return (bool(self._events) or (self.file is not None and self.file.has_news)
                or (self.peer is not None and self.peer.has_news))

    @property
    def pending_loads(self) -> int:
        """Loads started and neither polled nor cancelled (0 when idle: nothing leaks)."""
        return len(self._loads)

    # ---- down ------------------------------------------------------------------------------
    def offload_many(self, blocks: list[int], hashes: list[bytes]) -> None:
        """Copy pool ``blocks`` (cached as ``hashes``) down, those no tier has yet, in one gather and
        one copy per run of host slots (the block manager's ``on_evict``: the blocks one
        allocation evicts, before they are handed out)."""
        if self.host is None and (self.file is None or not self.file.enabled):
            return
        todo = [(b, h) for b, h in zip(blocks, hashes)
                if h not in (self.host or ()) and (self.file is None or not self.file.knows(h))]
        if not todo:
            return
        if self.host is None:
            kvs, ready = self._snapshot(self._gather([b for b, _ in todo]))
            for (_, block_hash), kv in zip(todo, kvs):
                self.file.put(block_hash, kv, ready)  # type: ignore[union-attr]
            return
        started = time.perf_counter()
        slots, evicted = self.host.claim(len(todo))
        todo = todo[:len(slots)]  # more than the tier holds (or every slot leased): the rest is not kept
        if evicted:  # one event for the lot: the hashes of a tier's event are a set, not a chain
            self._events.append(BlockRemoved(tuple(h for h, _ in evicted), medium=MEDIUM_HOST))
        for old_hash, old_slot in evicted:
            if self.file is not None and not self.file.knows(old_hash):
                self.file.put(old_hash, self.host.read(old_slot), None)
        if todo:
            kv = self._gather([b for b, _ in todo])  # on the current stream, after the steps that wrote the blocks
            with self._copying(after=True, keep=kv):
                self.host.fill([h for _, h in todo], slots, kv)
            self._events.append(BlockStored(tuple(h for _, h in todo), None, (), 0, medium=MEDIUM_HOST))
        self.host.store_seconds += time.perf_counter() - started

    def _gather(self, blocks: list[int]) -> torch.Tensor:
        """The blocks' KV on the pool's device, ``[n, layers, 2, block_size, kv_heads, head_dim]``, contiguous:
        one kernel over the pool's block-major view, else one per layer."""
        ids = self._ids(blocks)
        if self.pool_blocks is not None:
            return self.pool_blocks.index_select(0, ids)
        out = torch.empty((len(blocks), *self.block_shape), dtype=self.kv_caches[0].dtype, device=self.device)
        for layer, cache in enumerate(self.kv_caches):
            torch.index_select(cache, 1, ids, out=out[:, layer].transpose(0, 1))
        return out

    def _ids(self, blocks: list[int]) -> torch.Tensor:
        """``blocks`` as an index on the pool's device, copied without waiting: ``torch.tensor(...,
        device=)`` waits for everything queued on the stream (the step in flight) before it returns."""
        ids = torch.tensor(blocks, dtype=torch.int64)
        return ids if self.device.type == "cpu" else ids.pin_memory().to(self.device, non_blocking=True)

    @contextmanager
    def _copying(self, after: bool, keep: torch.Tensor | None = None) -> Iterator[None]:
        """What is queued inside runs on the copy stream (without one, where it is): ``after`` what
        the current stream has queued so far; ``keep`` (made on the current stream) is not handed out
        again before those copies ran."""
        if self.copy_stream is None:
            yield
            return
        if after:
            self.copy_stream.wait_stream(torch.cuda.current_stream(self.device))
        if keep is not None:
            keep.record_stream(self.copy_stream)
        with torch.cuda.stream(self.copy_stream):
            yield

    def _snapshot(self, kv: torch.Tensor) -> tuple[list[torch.Tensor], object]:
        """``kv`` (from :meth:`_gather`) in host memory, one view per block; on CUDA one pinned
        tensor, copied at once, and the event that marks the copy done (queued on the current
        stream: any later write to the blocks runs after it)."""
        if self.device.type == "cpu":
            return list(kv.unbind(0)), None
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
        host.copy_(kv, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return list(host.unbind(0)), ready

    # ---- up --------------------------------------------------------------------------------
    def lookup(self, hashes: list[bytes], peer: tuple[str, int] | None = None) -> Found:
        """Where each leading block of ``hashes`` is (highest tier first), up to the first no tier holds;
        then, with ``peer`` (a KV address and how many of ``hashes`` it holds, the proxy's hint), the
        blocks after those up to that count, from the peer. Host-tier blocks are leased until
        :meth:`start_load`: allocating the blocks to load them into may evict pool blocks into the
        host tier, and those must not take these slots."""
        found = Found([], [])
        if self.host is not None:
            self.host.leased.clear()  # a new lookup: the last one was loaded, or given up
        self._lookups += 1
        disk = self.file is not None and self.file.enabled and self._pays(MEDIUM_DISK)
        for block_hash in hashes:
            medium = None
            if self.host is not None:
                self.queried[MEDIUM_HOST] += 1
                if block_hash in self.host:
                    medium = MEDIUM_HOST
            kv: torch.Tensor | int | None = None
            if medium == MEDIUM_HOST:
                kv = self.host.get(block_hash)  # type: ignore[union-attr]
                self.host.leased.add(kv)  # type: ignore[union-attr]
            if medium is None and disk:
                self.queried[MEDIUM_DISK] += 1
                kv = self.file.queued(block_hash)  # type: ignore[union-attr]
                if kv is not None or self.file.contains(block_hash):  # type: ignore[union-attr]
                    medium = MEDIUM_DISK
            if medium is None:
                break
            self.found[medium] += 1
            found.mediums.append(medium)
            found.kv.append(kv)
        wanted = min(peer[1], len(hashes)) - len(found) if peer is not None and self.peer is not None else 0
        if wanted > 0 and self._pays(MEDIUM_PEER):
            self.queried[MEDIUM_PEER] += wanted
            found.peer = peer[0]  # type: ignore[index]
            found.mediums += [MEDIUM_PEER] * wanted
            found.kv += [None] * wanted
        return found

    def _pays(self, medium: str) -> bool:
        """Loading from ``medium`` (the file tier, a peer) beats computing, as measured: a block's load
        (its wall time, waits included) against its tokens' prefill. Unmeasured: load (and measure).
        One lookup in EXPLORE_EVERY loads anyway (counted once per lookup, whatever the tiers asked),
        so a rate measured at a bad moment is measured again."""
        per_s, s_per_block = self.prefill_tokens_per_s(), self.s_per_block[medium]
        if self.always_load or s_per_block is None or not per_s or self._lookups % EXPLORE_EVERY == 0:
            return True
        return s_per_block < self.block_shape[2] / per_s

    def _load_rate(self, medium: str) -> float:
        """``medium``'s measured load rate in bytes/s (0 until measured): what the proxy weighs a hit by."""
        s_per_block = self.s_per_block[medium]
        return self.block_bytes / s_per_block if s_per_block else 0.0

    def start_load(self, job: str, hashes: list[bytes], found: Found, blocks: list[int]) -> int | None:
        """Fill ``blocks`` with ``hashes``' KV (``found`` by :meth:`lookup`). None while the file
        tier still reads (:meth:`poll` reports the job); else how many leading blocks are filled
        (every block in memory: copied now)."""
        load = _Load(list(blocks), list(found.mediums))
        started = time.perf_counter()
        now = [(block, kv) for block, kv in zip(blocks, found.kv) if kv is not None]
        self._copy_in([b for b, _ in now], [kv for _, kv in now])
        if self.host is not None:
            self.host.leased.clear()  # queued on the stream before any later copy into those slots
        for i, (kv, medium) in enumerate(zip(found.kv, found.mediums)):
            if kv is None:
                load.parts.setdefault(medium, []).append(i)
            else:
                self.disk_hits += medium == MEDIUM_DISK
        if self.host is not None:
            self.host.load_seconds += time.perf_counter() - started
        if not load.parts:
            return len(load.blocks)
        load.started = time.monotonic()
        self._loads[job] = load
        if MEDIUM_DISK in load.parts:
            self.file.load(job, [hashes[i] for i in load.parts[MEDIUM_DISK]])  # type: ignore[union-attr]
        if MEDIUM_PEER in load.parts:
            self.peer.load(job, found.peer, [hashes[i] for i in load.parts[MEDIUM_PEER]])  # type: ignore[union-attr,arg-type]
        return None

    def poll(self) -> list[tuple[str, int]]:
        """Finished loads: (job, leading blocks filled). The rest of each job's blocks hold nothing usable."""
        if self.file is not None:
            for stored, block_hash in self.file.take_changes():
                self._events.append(BlockStored((block_hash,), None, (), 0, medium=MEDIUM_DISK) if stored
                                    else BlockRemoved((block_hash,), medium=MEDIUM_DISK))
        done = self._timed_out()
        for medium, source in ((MEDIUM_DISK, self.file), (MEDIUM_PEER, self.peer)):
            for job, tensors in source.take_loaded() if source is not None else ():
                load = self._loads.get(job)
                if load is None or medium not in load.parts:
                    continue  # cancelled: what was read is dropped
                self._part_landed(load, medium, tensors)
        for job, load in list(self._loads.items()):
            if len(load.landed) == len(load.parts):
                del self._loads[job]
                cut = load.cut()
                self.lost += len(load.mediums) - cut
                done.append((job, cut))
        return done

    def _part_landed(self, load: _Load, medium: str, tensors: list[torch.Tensor]) -> None:
        """One part of a load finished: its leading ``tensors`` into their blocks, its rate measured."""
        positions = load.parts[medium]
        self._copy_in([load.blocks[p] for p in positions[:len(tensors)]], tensors)
        load.landed[medium] = len(tensors)
        elapsed = time.monotonic() - load.started
        if medium == MEDIUM_DISK:
            self.disk_hits += len(tensors)
        else:
            self.found[MEDIUM_PEER] += len(tensors)
            self.peer_seconds += elapsed
            self.peer_errors += len(tensors) < len(positions)
        if tensors:
            per_block, old = elapsed / len(tensors), self.s_per_block[medium]
            self.s_per_block[medium] = per_block if old is None else old + _EWMA * (per_block - old)

    def _timed_out(self) -> list[tuple[str, int]]:
        """Loads asked more than LOAD_TIMEOUT_S ago: given up (what comes for them later is dropped);
        their blocks before the first one still missing are filled, the rest is computed."""
        now, done = time.monotonic(), []
        for job, load in list(self._loads.items()):
            if now - load.started > LOAD_TIMEOUT_S:
                self.cancel(job)
                self.timeouts += 1
                cut = load.cut()
                logger.warning("KV tiers: a load of %d blocks (%s) took over %.0f s; computing %d of them instead",
                               len(load.mediums), "/".join(load.parts), LOAD_TIMEOUT_S, len(load.mediums) - cut)
                self.lost += len(load.mediums) - cut
                done.append((job, cut))
        return done

    def cancel(self, job: str) -> None:
        """Forget ``job`` (its request was aborted); its blocks are the caller's to free now."""
        load = self._loads.pop(job, None)
        if load is None:
            return
        if MEDIUM_DISK in load.parts and self.file is not None:
            self.file.cancel(job)
        if MEDIUM_PEER in load.parts and self.peer is not None:
            self.peer.cancel(job)

    def _copy_in(self, blocks: list[int], kvs: list[torch.Tensor | int]) -> None:
        """Write ``kvs`` (host-tier slots or tensors) into pool ``blocks``: one copy to the device per
        run of adjacent slots (on the copy stream), then one scatter over the pool's block-major view
        (else one per layer)."""
        if not blocks:
            return
        slots = [kv if isinstance(kv, int) else None for kv in kvs]
        # host-tier slots were filled on the copy stream, in order; a tensor may be a pinned snapshot
        # whose device-to-host copy is queued on the current stream: then the copies wait for it
        with self._copying(after=None in slots):
            staged = torch.empty((len(blocks), *self.block_shape), dtype=self.kv_caches[0].dtype,
                                 device=self.device)  # the copy stream's memory: written there first
            for start, stop in runs(slots):
                first = slots[start]
                if first is not None:
                    staged[start:stop].copy_(self.host.slab[first:first + stop - start], non_blocking=True)  # type: ignore[union-attr]
                else:  # a tensor alone, on the stream: only the stream orders a read after a pinned
                    # snapshot's copy (a host-side stack would not wait)
                    staged[start].copy_(kvs[start], non_blocking=True)  # type: ignore[arg-type]
            ids = self._ids(blocks)
        if self.copy_stream is not None:  # the scatter (on the current stream) after the copies
            current = torch.cuda.current_stream(self.device)
            current.wait_stream(self.copy_stream)
            staged.record_stream(current)
            ids.record_stream(current)
        if self.pool_blocks is not None:
            self.pool_blocks.index_copy_(0, ids, staged)
            return
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, ids, staged[:, layer].transpose(0, 1))

    # ---- reporting ---------------------------------------------------------------------------
    def take_events(self) -> list[CacheEvent]:
        """Blocks that entered or left a tier since the last call (KV events with their ``medium``)."""
        events, self._events = self._events, []
        return events

    def stats(self) -> dict[str, dict[str, float]]:
        """Per tier: bytes, blocks, hits, misses, load/store seconds, errors, dropped stores; and the
        measured load rate in bytes/s (what the proxy weighs a tier hit by)."""
        out = {}
        if self.host is not None:
            h = self.host
            out["host"] = {"bytes": h.bytes, "blocks": h.blocks, "hits": h.hits,
                           "misses": self.queried[MEDIUM_HOST] - self.found[MEDIUM_HOST],
                           "load_seconds": h.load_seconds, "store_seconds": h.store_seconds, "errors": 0,
                           "dropped": 0, "served": h.served,
                           "load_bytes_per_s": h.loaded_bytes / h.load_seconds if h.load_seconds else 0.0}
        if self.file is not None:
            f = self.file
            out["disk"] = {"bytes": f.bytes, "blocks": f.blocks, "hits": self.disk_hits,
                           "misses": self.queried[MEDIUM_DISK] - self.found[MEDIUM_DISK] + f.load_errors,
                           "load_seconds": f.load_seconds, "store_seconds": f.store_seconds,
                           "errors": f.load_errors + f.store_errors + self.timeouts, "dropped": f.dropped,
                           "served": f.blocks_served,
                           "load_bytes_per_s": self._load_rate(MEDIUM_DISK)}
        if self.peer is not None:
            out["peer"] = {"bytes": 0, "blocks": 0, "hits": self.found[MEDIUM_PEER],
                           "misses": self.queried[MEDIUM_PEER] - self.found[MEDIUM_PEER],
                           "load_seconds": self.peer_seconds, "store_seconds": 0.0, "errors": self.peer_errors,
                           "dropped": 0, "load_bytes_per_s": self._load_rate(MEDIUM_PEER)}
        return out

    def read_blocks(self, blocks: list[int], then: list[bytes] = ()) -> tuple[int, bytes]:
        """What the peer tier serves: pool ``blocks``' KV, every layer's K and V of a block, block after
        block, in host memory, then that of the leading hashes of ``then`` the host tier holds; the
        count and the bytes (a copy: nothing stays held for the asker)."""
        parts = [self._gather(blocks).cpu()] if blocks else []
        for block_hash in then if self.host is not None else ():
            if block_hash not in self.host:
                break
            parts.append(self.host.copy_of(block_hash).unsqueeze(0))
            self.host.served += 1
        if not parts:
            return 0, b""
        kv = torch.cat(parts) if len(parts) > 1 else parts[0]
        return kv.shape[0], kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
