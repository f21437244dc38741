"""Prefix caching in the block manager and the hash chain: reuse, ref counts, LRU eviction."""

from __future__ import annotations

import pytest

from common.engine.block_hash import extend_hashes, root_hash
from common.engine.block_manager import BlockManager


def hashes(tokens: list[int], block_size: int = 4, root: bytes | None = None) -> list[bytes]:
    out: list[bytes] = []
    root = root if root is not None else root_hash("m", block_size)
    extend_hashes(out, root, lambda a, b: tokens[a:b], block_size, len(tokens) // block_size)
    return out


def test_hash_chain_names_the_whole_prefix():
    a = hashes([1, 2, 3, 4, 5, 6, 7, 8])
    b = hashes([9, 2, 3, 4, 5, 6, 7, 8])
    assert len(a) == 2 and a[0] != b[0]
    assert a[1] != b[1]  # same tokens in block 1, different prefix: different name
    assert hashes([1, 2, 3, 4, 5, 6, 7, 8, 9]) == a  # the partial block is never named
    assert hashes([1, 2, 3, 4], root=root_hash("other model", 4)) != a[:1]


def test_extend_keeps_what_was_hashed():
    tokens = list(range(12))
    out: list[bytes] = []
    extend_hashes(out, root_hash(), lambda a, b: tokens[a:b], 4, 1)
    first = out[0]
    extend_hashes(out, root_hash(), lambda a, b: tokens[a:b], 4, 3)
    assert out[0] is first and len(out) == 3 and out == hashes(tokens, root=root_hash())


def computed(bm: BlockManager, num_blocks: int) -> tuple[list[int], list[bytes]]:
    """A table of ``num_blocks`` full blocks, computed and cached, and their hashes."""
    h = hashes(list(range(num_blocks * bm.block_size)))
    table = bm.allocate(num_blocks)
    for b, hb in zip(table, h):
        bm.cache_block(b, hb)
    return table, h


def test_cached_blocks_are_shared_and_survive_free():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    table, h = computed(bm, 3)
    assert bm.take_cached(h) == table  # shared while the first holder still has them
    bm.release(list(table))
    assert bm.num_free_blocks == 1  # the second holder keeps them
    bm.free(table)
    assert bm.num_free_blocks == 4 and bm.num_cached_blocks == 3  # free, still reusable
    assert bm.take_cached(h[:2]) == table[:2] and bm.num_free_blocks == 2
    assert bm.take_cached([b"unknown"] + h) == []  # a chain is matched from its start


def test_allocation_evicts_cached_blocks_lru_and_never_held_ones():
    bm = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=True)
    table, h = computed(bm, 4)
    held = bm.take_cached(h[:1])  # block 0 stays held by someone else
    bm.release(list(table))  # freed last block first: tail evicted first
    assert bm.num_free_blocks == 3
    new = bm.allocate(2)
    assert new == [table[3], table[2]] and table[0] not in new
    assert bm.num_cached_blocks == 2
    assert bm.take_cached(h) == [table[0], table[1]]  # the chain breaks at the first evicted block
    with pytest.raises(RuntimeError):
        bm.allocate(1)  # every block is held now
    bm.free(held + [table[0], table[1]] + new)
    assert bm.num_free_blocks == 4


def test_empty_blocks_go_before_cached_ones():
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=True)
    [b] = bm.allocate(1)
    bm.cache_block(b, hashes([1, 2, 3, 4])[0])
    bm.free([b])
    assert b not in bm.allocate(2) and bm.num_cached_blocks == 1


def test_same_prefix_computed_twice_keeps_the_first_block():
    bm = BlockManager(num_blocks=2, block_size=4, enable_prefix_caching=True)
    [h] = hashes([1, 2, 3, 4])
    a, b = bm.allocate(2)
    bm.cache_block(a, h)
    bm.cache_block(b, h)
    bm.free([a, b])
    assert bm.take_cached([h]) == [a] and bm.num_cached_blocks == 1


def test_without_prefix_caching_nothing_is_cached():
    bm = BlockManager(num_blocks=2, block_size=4)
    [h] = hashes([1, 2, 3, 4])
    [a] = bm.allocate(1)
    bm.cache_block(a, h)
    assert bm.take_cached([h]) == [] and bm.num_cached_blocks == 0
