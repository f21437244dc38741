from __future__ import annotations

import pytest

from common.engine.block_manager import BlockManager, NoFreeBlocksError


def test_allocate_free_and_refcount():
    bm = BlockManager(num_blocks=4, block_size=16)
    a = bm.allocate(3)
    assert len(set(a)) == 3 and bm.num_free_blocks == 1
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2)
    bm.fork(a[:1])
    bm.free(a)
    assert bm.num_free_blocks == 3  # a[0] still held by the fork
    bm.free(a[:1])
    assert bm.num_free_blocks == 4
    with pytest.raises(ValueError):
        bm.free(a[:1])


def test_ensure_capacity_grows_table_by_blocks():
    bm = BlockManager(num_blocks=3, block_size=4)
    table: list[int] = []
    assert bm.ensure_capacity(table, 5) and len(table) == 2
    assert bm.ensure_capacity(table, 8) and len(table) == 2
    assert not bm.ensure_capacity(table, 13) and len(table) == 2  # needs 4 blocks, unchanged
    bm.release(table)
    assert table == [] and bm.num_free_blocks == 3


def test_fresh_requests_get_consecutive_blocks_even_after_churn():
    bm = BlockManager(num_blocks=64, block_size=16)
    tables = [bm.allocate(n) for n in (5, 3, 7, 2, 9)]
    assert all(t == list(range(t[0], t[0] + len(t))) for t in tables)  # each one run
    bm.free(tables[1])  # a 3-block hole at 5..7
    bm.free(tables[3])  # a 2-block hole at 15..16
    big = bm.allocate(6)
    assert big == list(range(26, 32))  # the lowest run that fits, not the holes
    assert bm.allocate(3) == [5, 6, 7]  # a hole that fits exactly is reused
    assert bm.allocate(2) == [15, 16]


def test_without_a_run_the_lowest_free_blocks_go_first():
    bm = BlockManager(num_blocks=8, block_size=16)
    a = bm.allocate(8)
    bm.free([a[1], a[2], a[5], a[7]])
    assert bm.allocate(3) == [1, 2, 5] and bm.num_free_blocks == 1
    assert bm.allocate(1) == [7]
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1)
