"""Gather a request's blocks out of a paged KV layer and scatter them back in.

A layer is ``[2, num_blocks, block_size, kv_heads, head_dim]``; a request's part is
``layer[:, block_ids]``. Both directions take one copy; a contiguous run of block ids
uses a slice copy instead of an index copy.
"""

from __future__ import annotations

import threading

import torch


def block_run(block_ids: list[int]) -> slice | None:
    """The ids as a slice when they are one ascending contiguous run, else None."""
    if block_ids and block_ids == list(range(block_ids[0], block_ids[0] + len(block_ids))):
        return slice(block_ids[0], block_ids[0] + len(block_ids))
    return None


def block_runs(block_ids: list[int]) -> list[slice]:
    """The ids as ascending contiguous runs, in order: [4, 5, 9, 2, 3] -> 4:6, 9:10, 2:4."""
    runs: list[slice] = []
    for b in block_ids:
        if runs and runs[-1].stop == b:
            runs[-1] = slice(runs[-1].start, b + 1)
        else:
            runs.append(slice(b, b + 1))
    return runs


def gather_blocks(kv_layer: torch.Tensor, block_ids: list[int],
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``kv_layer[:, block_ids]`` as a contiguous tensor (into ``out`` when given)."""
    run = block_run(block_ids)
    if out is None:
        if run is not None:
            return kv_layer[:, run].contiguous()
        return kv_layer.index_select(1, torch.tensor(block_ids, device=kv_layer.device))
    if run is not None:
        out.copy_(kv_layer[:, run])
    else:  # index_select into ``out`` copies once; ``out.copy_(kv[:, ids])`` would copy twice
        torch.index_select(kv_layer, 1, torch.tensor(block_ids, device=kv_layer.device), out=out)
    return out


def scatter_blocks(kv_layer: torch.Tensor, block_ids: list[int], src: torch.Tensor) -> None:
    """``kv_layer[:, block_ids] = src`` in place."""
    run = block_run(block_ids)
    if run is not None:
        kv_layer[:, run].copy_(src)
    else:
        kv_layer.index_copy_(1, torch.tensor(block_ids, device=kv_layer.device), src)


class StagingBuffer:
    """One reusable byte buffer viewed as any dtype/shape; grows, never shrinks."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self._buf = torch.empty(0, dtype=torch.uint8, device=device)

    def view(self, dtype: torch.dtype, shape: tuple[int, ...] | list[int]) -> torch.Tensor:
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        if self._buf.numel() < nbytes:
            self._buf = torch.empty(nbytes, dtype=torch.uint8, device=self._buf.device)
        return self._buf[:nbytes].view(dtype).view(tuple(shape))


class ByteBudget:
    """Bytes staged for sending; ``try_acquire`` never blocks (the engine thread calls it)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0
        self._lock = threading.Lock()

    def try_acquire(self, nbytes: int) -> bool:
        with self._lock:
            if self.in_flight + nbytes > self.limit:
                return False
            self.in_flight += nbytes
            return True

    def release(self, nbytes: int) -> None:
        with self._lock:
            self.in_flight -= nbytes
