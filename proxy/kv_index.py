"""Which node holds which KV block: the proxy's index of the daemons' KV events.

One entry per block hash: the nodes that hold it, as a bitmask over small node numbers. The index
is bounded: at most ``max_blocks`` hashes, the least recently used (stored or matched) forgotten
first. Forgetting only ever under-counts -- a node is then thought not to hold a block it holds,
so a request goes by load, never to a node for a block it lacks.

Clearing a node (its cache reset, it restarted, a snapshot follows, it left) is O(1): the node
gets a new number and the old one is *retired*. A retired bit left in a mask means nothing (a
lookup reads only current numbers) and is stripped when its entry is next stored to, removed or
evicted; a count per number says how many masks still carry it, and a retired number is handed
out again only once none does. Scanning a million entries instead held the GIL for 0.3-0.6 s on
the 2-core VM: every request routed meanwhile would have waited (only with every number retired
and still carried does a clear fall back to that scan).

Memory: an entry is a 16-byte hash (49 bytes as a Python ``bytes``) plus its mask and its
``OrderedDict`` slot (105 bytes measured with tracemalloc, two nodes): ~160 bytes, a little more
per 30 nodes a hash is shared by. The default 1,000,000 blocks is therefore ~160 MB at most;
``--kv-index-max-blocks`` sets it (the bound: tests/proxy/test_kv_index.py::
test_bound_evicts_least_recently_used).

Blocks a node keeps in a KV tier behind its pool (host memory, files: common/engine/kv_tiers.py)
arrive as events with a ``medium``; each tier medium has an index of its own (:meth:`KVIndex.tier`,
bounded alike), cleared and forgotten with the node's pool index and fresh when it is. A tier hit
is worth less than a pool hit (the node must load it): proxy/exact_prefix.py weighs it.

A node is *fresh* while its events are known complete: its subscriber (``proxy/kv_subscriber.py``)
applied every batch up to what the node last published, recently. Only a fresh node's blocks
count; any other node is cache-unknown (its count is 0). One lock: the subscriber thread writes,
the event loop reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from common.kv_events import TIER_MEDIUMS

NodeKey = tuple[str, str]  # (type, http_address), the registry's key
DEFAULT_MAX_BLOCKS = 1_000_000


class KVIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, max_nodes: int = 4096) -> None:
        self.max_blocks, self.max_nodes = max_blocks, max_nodes
        self._holders: OrderedDict[bytes, int] = OrderedDict()  # hash -> bitmask of node numbers
        self._number: dict[NodeKey, int] = {}  # each indexed node's current number
        self._carried = [0] * max_nodes  # per number: the masks that have its bit
        self._retired: set[int] = set()  # numbers of cleared nodes whose bits some masks still carry
        self._live = 0  # the current numbers' bits
        self._fresh: set[NodeKey] = set()
        self._lock = threading.Lock()
        self.evicted = 0  # hashes forgotten for room
        self._tiers: dict[str, KVIndex] = {}  # medium -> the index of the blocks nodes hold in that tier

    def __len__(self) -> int:
        """Entries kept (some may hold only retired bits until touched or evicted)."""
        return len(self._holders)

    def nodes(self) -> set[NodeKey]:
        """The nodes indexed now."""
        with self._lock:
            return set(self._number)

    def tier(self, medium: str) -> KVIndex | None:
        """The index of KV tier ``medium`` (made on first use); None for a medium not weighed."""
        if medium not in TIER_MEDIUMS:
            return None
        index = self._tiers.get(medium)
        if index is None:
            index = KVIndex(self.max_blocks, self.max_nodes)
            with self._lock:
                index._fresh = set(self._fresh)
                self._tiers[medium] = index
        return index

    def tiers(self) -> dict[str, KVIndex]:
        """The tier indexes made so far, by medium."""
        return dict(self._tiers)

    # ---- the subscriber's side ------------------------------------------------------------
    def stored(self, node: NodeKey, hashes: Sequence[bytes], chunk: int = 4096) -> None:
        """A chunk at a time under the lock: a snapshot of 400,000 hashes takes ~0.3 s, and routing
        must not wait for all of it (only this thread writes, so the chunks apply in order)."""
        for start in range(0, len(hashes), chunk):
            self._store(node, hashes[start:start + chunk])

    def _store(self, node: NodeKey, hashes: Sequence[bytes]) -> None:
        with self._lock:
            bit = self._bit(node)
            if bit == 0:
                return
            number, holders, live = bit.bit_length() - 1, self._holders, self._live
            for h in hashes:
                mask = holders.pop(h, 0)
                if mask & ~live:
                    self._uncount(mask & ~live)
                    mask &= live
                if not mask & bit:
                    self._carried[number] += 1
                holders[h] = mask | bit
            while len(holders) > self.max_blocks:
                self._uncount(holders.popitem(last=False)[1])
                self.evicted += 1

    def removed(self, node: NodeKey, hashes: Iterable[bytes]) -> None:
        with self._lock:
            bit = self._bit(node, create=False)
            if bit == 0:
                return
            holders = self._holders
            for h in hashes:
                mask = holders.get(h)
                if mask is None or not mask & bit:
                    continue
                self._uncount(bit)
                if mask & ~bit & self._live:
                    holders[h] = mask & ~bit
                else:
                    self._uncount(mask & ~bit)  # only retired bits left
                    del holders[h]

    def cleared(self, node: NodeKey) -> None:
        """The node holds nothing (its cache was reset, it restarted, or a snapshot follows)."""
        with self._lock:
            if node in self._number:
                self._retire(node)
                self._bit(node)
        for index in list(self._tiers.values()):  # a snapshot follows for the pool only: tier blocks under-count
            index.cleared(node)

    def forget(self, node: NodeKey) -> None:
        """The node left: its blocks, its number and its freshness go."""
        with self._lock:
            self._fresh.discard(node)
            if node in self._number:
                self._retire(node)
        for index in list(self._tiers.values()):
            index.forget(node)

    def set_fresh(self, node: NodeKey, fresh: bool) -> None:
        with self._lock:
            if fresh:
                self._fresh.add(node)
            else:
                self._fresh.discard(node)
        for index in list(self._tiers.values()):
            index.set_fresh(node, fresh)

    # ---- the router's side ----------------------------------------------------------------
    def is_fresh(self, node: NodeKey) -> bool:
        return node in self._fresh

    @property
    def has_fresh(self) -> bool:
        """Some node's events are usable (else a prompt's token ids would serve nothing)."""
        return bool(self._fresh)

    def any_fresh(self, nodes: Iterable[NodeKey]) -> bool:
        return any(n in self._fresh for n in nodes)

    def leading(self, nodes: list[NodeKey], hashes: list[bytes]) -> dict[NodeKey, int]:
        """For each of ``nodes``, how many of ``hashes`` (a prompt's chain, in order) it holds from
        the first on; 0 for a node that is not fresh. The matched hashes count as used."""
        with self._lock:
            counts = dict.fromkeys(nodes, 0)
            live = {n: 1 << self._number[n] for n in nodes if n in self._fresh and n in self._number}
            for h in hashes:
                mask = self._holders.get(h)
                if mask is None or not live:
                    break
                self._holders.move_to_end(h)
                for n, bit in list(live.items()):
                    if mask & bit:
                        counts[n] += 1
                    else:
                        del live[n]
            return counts

    def held(self, node: NodeKey, hashes: Sequence[bytes]) -> list[bool]:
        """For each of ``hashes``, whether fresh ``node`` holds it (all False when it is not fresh)."""
        with self._lock:
            number = self._number.get(node)
            if number is None or node not in self._fresh:
                return [False] * len(hashes)
            bit = 1 << number
            return [bool(self._holders.get(h, 0) & bit) for h in hashes]

    # ---- inside the lock --------------------------------------------------------------------
    def _bit(self, node: NodeKey, create: bool = True) -> int:
        """The node's current bit (0: none, and ``create`` False or no number free)."""
        number = self._number.get(node)
        if number is None:
            if not create:
                return 0
            used = set(self._number.values()) | self._retired
            number = next((i for i in range(self.max_nodes) if i not in used), None)
            if number is None:
                self._sweep()  # every number in use or still carried: scan the retired bits away
                used = set(self._number.values())
                number = next((i for i in range(self.max_nodes) if i not in used), None)
                if number is None:
                    return 0  # more nodes than max_nodes: the newest go unindexed (cache-unknown)
            self._number[node] = number
            self._live |= 1 << number
        return 1 << number

    def _retire(self, node: NodeKey) -> None:
        number = self._number.pop(node)
        self._live &= ~(1 << number)
        if self._carried[number]:
            self._retired.add(number)

    def _uncount(self, mask: int) -> None:
        """``mask``'s bits leave one entry."""
        while mask:
            low = mask & -mask
            number = low.bit_length() - 1
            self._carried[number] -= 1
            if not self._carried[number]:
                self._retired.discard(number)
            mask ^= low

    def _sweep(self) -> None:
        """Strip every retired bit from every mask: O(index size), the last resort of ``_bit``."""
        live, holders = self._live, self._holders
        for h in [h for h, mask in holders.items() if mask & ~live]:
            mask = holders[h]
            self._uncount(mask & ~live)
            if mask & live:
                holders[h] = mask & live
            else:
                del holders[h]
