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
