"""Tensor-parallel helpers: aggregate per-worker completions; map local to remote TP ranks."""

from __future__ import annotations

from dataclasses import dataclass

from common.engine.kv_connector import FinishedTransfers


class KVOutputAggregator:
    """Reports a request finished only once every one of ``world_size`` TP workers has.

    A failure from any worker fails the request at once; the other workers' later
    reports for it are swallowed so it is never reported twice.
    """

    def __init__(self, world_size: int) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = world_size
        self._sending: dict[str, int] = {}
        self._recving: dict[str, int] = {}
        self._failed: dict[str, int] = {}  # request -> reports still expected after a failure

    def aggregate(self, outputs: list[FinishedTransfers]) -> FinishedTransfers:
        out = FinishedTransfers()
        for worker in outputs:
            for rid in worker.done_sending:
                if self._count(self._sending, rid):
                    out.done_sending.add(rid)
            for rid, reason in worker.failed_recving.items():
                if self._swallow(rid):
                    continue
                reported = self.world_size - self._recving.pop(rid, self.world_size)
                self._failed[rid] = self.world_size - 1 - reported
                if self._failed[rid] == 0:
                    del self._failed[rid]
                out.failed_recving[rid] = reason
            for rid, token in worker.done_recving.items():
                if not self._swallow(rid) and self._count(self._recving, rid):
                    out.done_recving[rid] = token
        return out

    def _count(self, remaining: dict[str, int], rid: str) -> bool:
        remaining[rid] = remaining.get(rid, self.world_size) - 1
        if remaining[rid] == 0:
            del remaining[rid]
            return True
        return False

    def _swallow(self, rid: str) -> bool:
        if rid not in self._failed:
            return False
        self._failed[rid] -= 1
        if self._failed[rid] == 0:
            del self._failed[rid]
        return True


@dataclass(frozen=True)
class HeadRange:
    """Exchange KV heads [start, stop) (global head ids) with ``remote_rank``."""

    remote_rank: int
    start: int
    stop: int


@dataclass(frozen=True)
class TpKVTopology:
    """Which remote TP rank(s) a local TP rank exchanges KV heads with.

    Heads are split evenly over TP ranks; when a side has more ranks than KV heads each
    head is replicated on ``tp_size // num_kv_heads`` ranks. Works in both directions:
    local TP larger than remote (several local ranks read one remote rank) or smaller
    (one local rank reads from several remote ranks).
    """

    tp_rank: int
    tp_size: int
    remote_tp_size: int
    total_num_kv_heads: int

    def __post_init__(self) -> None:
        for size in (self.tp_size, self.remote_tp_size):
            big, small = max(size, self.total_num_kv_heads), min(size, self.total_num_kv_heads)
            if big % small:
                raise ValueError(f"TP size {size} and {self.total_num_kv_heads} KV heads do not divide")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} outside [0, {self.tp_size})")

    def heads_of(self, rank: int, size: int) -> range:
        """Global KV heads held by ``rank`` of a ``size``-way TP group."""
        if size <= self.total_num_kv_heads:
            per = self.total_num_kv_heads // size
            return range(rank * per, (rank + 1) * per)
        head = rank // (size // self.total_num_kv_heads)
        return range(head, head + 1)

    @property
    def tp_ratio(self) -> float:
        """Local ranks per remote rank (< 1 when the remote side has more ranks)."""
        return self.tp_size / self.remote_tp_size

    def remote_ranges(self) -> list[HeadRange]:
        """Each remote rank this rank exchanges with, and which of our heads it covers."""
        out: list[HeadRange] = []
        for head in self.heads_of(self.tp_rank, self.tp_size):
            holders = [q for q in range(self.remote_tp_size) if head in self.heads_of(q, self.remote_tp_size)]
            q = holders[self.tp_rank % len(holders)]  # spread replicated heads over their holders
            if out and out[-1].remote_rank == q and out[-1].stop == head:
                out[-1] = HeadRange(q, out[-1].start, head + 1)
            else:
                out.append(HeadRange(q, head, head + 1))
        return out

    def remote_ranks(self) -> list[int]:
        return [r.remote_rank for r in self.remote_ranges()]
