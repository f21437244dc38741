"""Which node holds which KV block: the proxy's index of the daemons' KV events.

One entry per block hash: the set of nodes that hold it, as a bitmask over small node numbers
(a node's number is freed when it leaves, and its bit cleared everywhere first). The index is
bounded: at most ``max_blocks`` hashes, the least recently used (stored or matched) forgotten
first. Forgetting only ever under-counts -- a node is then thought not to hold a block it holds,
so a request goes by load, never to a node for a block it lacks.

Memory: an entry is a 16-byte hash (49 bytes as a Python ``bytes``) plus its mask and its
``OrderedDict`` slot (105 bytes measured with tracemalloc, two nodes): ~160 bytes, a little more
per 30 nodes a hash is shared by. The default 1,000,000 blocks is therefore ~160 MB at most;
``--kv-index-max-blocks`` sets it (the bound: tests/proxy/test_kv_index.py::
test_bound_evicts_least_recently_used).

A node is *fresh* while its events are known complete: its subscriber (``proxy/kv_subscriber.py``)
applied every batch up to what the node last published, recently. Only a fresh node's blocks
count; any other node is cache-unknown (its count is 0). One lock: the subscriber thread writes,
the event loop reads.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

NodeKey = tuple[str, str]  # (type, http_address), the registry's key
DEFAULT_MAX_BLOCKS = 1_000_000


class KVIndex:
    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS, max_nodes: int = 4096) -> None:
        self.max_blocks, self.max_nodes = max_blocks, max_nodes
        self._holders: OrderedDict[bytes, int] = OrderedDict()  # hash -> bitmask of node numbers
        self._number: dict[NodeKey, int] = {}
        self._fresh: set[NodeKey] = set()
        self._lock = threading.Lock()
        self.evicted = 0  # hashes forgotten for room

    def __len__(self) -> int:
        return len(self._holders)

    # ---- the subscriber's side ------------------------------------------------------------
    def stored(self, node: NodeKey, hashes: Iterable[bytes]) -> None:
        with self._lock:
            bit = self._bit(node)
            if bit == 0:
                return
            holders = self._holders
            for h in hashes:
                mask = holders.pop(h, 0)
                holders[h] = mask | bit
            while len(holders) > self.max_blocks:
                holders.popitem(last=False)
                self.evicted += 1

    def removed(self, node: NodeKey, hashes: Iterable[bytes]) -> None:
        with self._lock:
            bit = self._bit(node, create=False)
            if bit == 0:
                return
            for h in hashes:
                mask = self._holders.get(h)
                if mask is None:
                    continue
                if mask & ~bit:
                    self._holders[h] = mask & ~bit
                else:
                    del self._holders[h]

    def cleared(self, node: NodeKey) -> None:
        """The node holds nothing (its cache was reset, it restarted, or a snapshot follows)."""
        with self._lock:
            self._clear(node)

    def forget(self, node: NodeKey) -> None:
        """The node left: its blocks, its number and its freshness go."""
        with self._lock:
            self._clear(node)
            self._number.pop(node, None)
            self._fresh.discard(node)

    def set_fresh(self, node: NodeKey, fresh: bool) -> None:
        with self._lock:
            if fresh:
                self._fresh.add(node)
            else:
                self._fresh.discard(node)

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
            bits = {n: self._number.get(n, -1) for n in nodes if n in self._fresh}
            live = {n: 1 << b for n, b in bits.items() if b >= 0}
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

    # ---- inside the lock --------------------------------------------------------------------
    def _bit(self, node: NodeKey, create: bool = True) -> int:
        number = self._number.get(node)
        if number is None:
            if not create:
                return 0
            used = set(self._number.values())
            number = next((i for i in range(self.max_nodes) if i not in used), None)
            if number is None:
                return 0  # more nodes than max_nodes: the newest go unindexed (cache-unknown)
            self._number[node] = number
        return 1 << number

    def _clear(self, node: NodeKey) -> None:
        """O(index size): only on a node's reset, restart or departure."""
        number = self._number.get(node)
        if number is None:
            return
        bit = 1 << number
        holders = self._holders
        for h in [h for h, mask in holders.items() if mask & bit]:
            mask = holders[h] & ~bit
            if mask:
                holders[h] = mask
            else:
                del holders[h]
