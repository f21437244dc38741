"""Names for full KV blocks: a hash chain over their tokens (prefix caching).

Block ``i``'s hash covers its own tokens and, through its parent's hash, every token
before it, so equal hashes mean equal prefixes and hence equal KV. The chain starts from
a root that names whatever else changes a block's content: the model and the block size.
A request's ``cache_salt`` (vLLM's field) is mixed in before its first block, so every
block of the chain differs by salt and only requests with the same salt share blocks: a
tenant cannot learn from time-to-first-token whether another tenant sent a prefix.
blake2b keeps collisions out of reach (a collision would silently serve wrong KV).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable

BlockHash = bytes


def root_hash(*identity: object) -> BlockHash:
    """The chain's root for this model and block size (parts joined by their repr)."""
    return hashlib.blake2b(repr(identity).encode(), digest_size=16).digest()


def salted_root(root: BlockHash, cache_salt: str | None) -> BlockHash:
    """The chain's root for a request with ``cache_salt`` (None: the shared, unsalted root).

    Salting the root is salting the first block's hash: each later block's name covers it."""
    if cache_salt is None:
        return root
    return hashlib.blake2b(root + b"salt:" + cache_salt.encode(), digest_size=16).digest()


def extend_hashes(hashes: list[BlockHash], root: BlockHash, token_ids: Callable[[int, int], list[int]],
                  block_size: int, num_blocks: int) -> None:
    """Grow ``hashes`` in place to name the first ``num_blocks`` full blocks; ``token_ids(start,
    end)`` gives the sequence's tokens (append-only, so hashes already made stay valid)."""
    for i in range(len(hashes), num_blocks):
        parent = hashes[i - 1] if i else root
        tokens = array("q", token_ids(i * block_size, (i + 1) * block_size))
        hashes.append(hashlib.blake2b(parent + tokens.tobytes(), digest_size=16).digest())
