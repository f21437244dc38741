"""Paged KV cache bookkeeping: which blocks are free, who holds which (ref-counted), and
which full blocks are cached by content (prefix caching).

A block is in exactly one state: held (ref-count > 0), free and empty of anything
reusable (``_free``), or free but cached (``_evictable``: its KV is still valid and named
by a block hash, so a later request with the same prefix takes it back). Allocation
prefers empty blocks and evicts cached ones least recently freed first; a held block
is never handed out, so a cached block in use can never be overwritten.

Empty blocks are handed out as the lowest contiguous run that fits, else lowest first:
a request's blocks then tend to be consecutive, and a KV transfer moves a run of blocks
as one piece (one iovec on tcp, no gather on gloo/nccl) instead of block by block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from common.engine.block_hash import BlockHash
from common.engine.cache_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventSink,
)


class NoFreeBlocksError(RuntimeError):
    """An allocation asked for more blocks than are free."""


class FreeBlocks:
    """The empty block ids, as a byte map (1 = free): finding a run of n free blocks is one
    ``bytearray.find`` in C, however many blocks the cache has."""

    def __init__(self, num_blocks: int) -> None:
        self._map = bytearray(b"\x01") * num_blocks
        self._count = num_blocks

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        return (b for b, free in enumerate(self._map) if free)

    def add(self, block: int) -> None:
        self._map[block] = 1
        self._count += 1

    def take(self, n: int) -> list[int]:
        """``n`` ids (at most ``len(self)``): the lowest run of ``n`` consecutive ones if there
        is one, else the lowest ``n`` (which still come in runs where the map has them)."""
        start = self._map.find(b"\x01" * n) if n > 1 else -1
        if start >= 0:
            ids = list(range(start, start + n))
            self._map[start:start + n] = bytes(n)
        else:
            ids, pos = [], 0
            for _ in range(n):
                pos = self._map.find(1, pos)
                ids.append(pos)
                self._map[pos] = 0
                pos += 1
        self._count -= n
        return ids


class BlockManager:
    """Hands out block ids ``0..num_blocks-1``; a block is free again at ref-count 0.

    With ``enable_prefix_caching`` a full, computed block can be registered under its
    hash (:meth:`cache_block`); :meth:`take_cached` returns the longest run of cached
    blocks for a chain of hashes, held for the caller.

    ``events``, when set, hears every change of the cached set (``cache_events``), on the
    caller's thread: a block stored, a cached block evicted, the cache cleared. ``on_evict``, when
    set, is called once per allocation with the cached blocks it evicts and their hashes, just
    before they are handed out for other KV (the KV tiers copy them down then: ``kv_tiers``).
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._free = FreeBlocks(num_blocks)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, ref 0; oldest first
        self._ref_counts = [0] * num_blocks
        self._cached: dict[BlockHash, int] = {}
        self._hash_of: dict[int, BlockHash] = {}
        self.events: EventSink | None = None
        self.on_evict: Callable[[list[int], list[BlockHash]], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can get now (cached-but-unused ones included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = self._free.take(min(num_blocks, len(self._free)))
        evicted = [self._evict() for _ in range(num_blocks - len(blocks))]
        if evicted and self.on_evict is not None:
            self.on_evict([b for b, _ in evicted], [h for _, h in evicted])
        blocks += [b for b, _ in evicted]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def _evict(self) -> tuple[int, BlockHash]:
        block, _ = self._evictable.popitem(last=False)  # least recently freed cached block
        block_hash = self._hash_of.pop(block)
        del self._cached[block_hash]
        if self.events is not None:
            self.events(BlockRemoved((block_hash,)))
        return block, block_hash

    def fork(self, block_ids: list[int]) -> None:
        """Share ``block_ids`` with one more holder (each holder frees them once)."""
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._ref_counts[b] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                if b in self._hash_of:
                    self._evictable[b] = None
                else:
                    self._free.add(b)

    def ensure_capacity(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow ``block_table`` in place to hold ``num_tokens``; False (unchanged) if blocks ran out."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing <= 0:
            return True
        if missing > self.num_free_blocks:
            return False
        block_table.extend(self.allocate(missing))
        return True

    def release(self, block_table: list[int]) -> None:
        """Free a sequence's blocks and empty its table.

        Last block first: a sequence's tail is the part least likely to be shared, so its
        cached blocks are the first evicted."""
        self.free(reversed(block_table))
        block_table.clear()

    # ---- prefix caching ----------------------------------------------------------------
    def cached_blocks(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks caching the longest prefix of ``hashes`` (not held: read them before any allocation)."""
        blocks = []
        if self.enable_prefix_caching:
            for h in hashes:
                b = self._cached.get(h)
                if b is None:
                    break
                blocks.append(b)
        return blocks

    def take_cached(self, hashes: list[BlockHash]) -> list[int]:
        """The blocks caching the longest prefix of ``hashes``, each held once more for the caller."""
        blocks = self.cached_blocks(hashes)
        for b in blocks:
            if self._ref_counts[b] == 0:
                del self._evictable[b]
            self._ref_counts[b] += 1
        return blocks

    def cache_block(self, block: int, block_hash: BlockHash, parent: BlockHash | None = None,
                    token_ids: tuple[int, ...] = ()) -> None:
        """Name the held, full, computed ``block`` by ``block_hash`` so others can reuse it
        (``parent`` and ``token_ids``: what the stored event says of it).

        A hash already cached (the same prefix computed twice at once) keeps its first block."""
        if not self.enable_prefix_caching or block in self._hash_of or block_hash in self._cached:
            return
        if self._ref_counts[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        self._cached[block_hash] = block
        self._hash_of[block] = block_hash
        if self.events is not None:
            self.events(BlockStored((block_hash,), parent, tuple(token_ids), self.block_size))

    def cached_hashes(self) -> list[BlockHash]:
        """Every cached block's hash. Safe from another thread: the copy is one C call over a dict
        of bytes keys, which no other thread interleaves with under the GIL."""
        return list(self._cached)

    def clear_cached(self) -> int:
        """Forget every cached block that no one holds (vLLM's prefix-cache reset); blocks in use
        keep their KV but are no longer named. Returns how many names were dropped."""
        dropped = len(self._cached)
        for block in self._evictable:
            self._free.add(block)
        self._evictable.clear()
        self._cached.clear()
        self._hash_of.clear()
        if self.events is not None:
            self.events(AllBlocksCleared())
        return dropped
