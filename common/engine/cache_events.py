"""What the prefix cache reports when it changes: the engine's side of KV events.

The block manager hands each change to a sink it is given (``BlockManager.events``): a block
named by its hash (stored), a cached block handed out for other KV (removed), every cached
block forgotten (cleared). The engine knows nothing of who listens; a daemon's publisher
(``common/node/kv_event_publisher.py``) numbers, batches and sends them in vLLM's KV-event
layout (``common/kv_events.py``). A sink runs on the engine thread, so it must not block.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.engine.block_hash import BlockHash


@dataclass(frozen=True)
class BlockStored:
    """Full blocks now cached: ``block_hashes`` in chain order, ``parent_block_hash`` the first's
    parent (None: the chain's first block), ``token_ids`` the blocks' tokens, in order."""

    block_hashes: tuple[BlockHash, ...]
    parent_block_hash: BlockHash | None
    token_ids: tuple[int, ...]
    block_size: int
    # None: the KV pool; else the tier (common/engine/kv_tiers.py: "CPU", "DISK"), whose events carry
    # no parent and no tokens, and whose ``block_hashes`` are a set (what one offload moved), not a chain
    medium: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Cached blocks whose KV is gone (evicted for another allocation)."""

    block_hashes: tuple[BlockHash, ...]
    medium: str | None = None  # as BlockStored's


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block is gone (a fresh or reset cache)."""


CacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
EventSink = Callable[[CacheEvent], None]
