"""Paged KV cache bookkeeping: which blocks are free, who holds which (ref-counted)."""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    """An allocation asked for more blocks than are free."""


class BlockManager:
    """Hands out block ids ``0..num_blocks-1``; a block returns to the free list at ref-count 0."""

    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"asked for {num_blocks} blocks, {len(self._free)} free")
        blocks = [self._free.popleft() for _ in range(num_blocks)]
        for b in blocks:
            self._ref_counts[b] = 1
        return blocks

    def fork(self, block_ids: list[int]) -> None:
        """Share ``block_ids`` with one more holder (each holder frees them once)."""
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} is not allocated")
            self._ref_counts[b] += 1

    def free(self, block_ids: list[int]) -> None:
        for b in block_ids:
            if self._ref_counts[b] <= 0:
                raise ValueError(f"block {b} freed twice")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free.append(b)

    def ensure_capacity(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow ``block_table`` in place to hold ``num_tokens``; False (unchanged) if blocks ran out."""
        missing = self.blocks_needed(num_tokens) - len(block_table)
        if missing <= 0:
            return True
        if missing > len(self._free):
            return False
        block_table.extend(self.allocate(missing))
        return True

    def release(self, block_table: list[int]) -> None:
        """Free a sequence's blocks and empty its table."""
        self.free(block_table)
        block_table.clear()
