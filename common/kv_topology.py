"""Which KV heads a tensor-parallel rank holds, and how to move them between TP sizes.

A model with ``kv`` KV heads run at TP size ``N`` shards them like
``common.model.tensor_parallel.shard_sizes``: rank ``r`` holds the global heads
``[r*kv//N, r*kv//N + max(1, kv//N))``. When ``kv < N`` heads are replicated:
rank ``r`` holds the single head ``r*kv//N``, shared by ``N//kv`` ranks. A valid
split needs ``kv % N == 0`` or ``N % kv == 0``. Each rank's paged cache is
``[2, num_blocks, block_size, heads_on_rank, head_dim]``, so a head's *local*
index is its global index minus the rank's first head.

``plan(src, dst)`` lists, per destination (decode) rank, the routes that deliver
each of its heads exactly once, each from one source (prefill) rank; no rank ever
gathers the whole KV. Worked examples:

* kv=8, a=2 -> b=4: src 0 holds 0-3, src 1 holds 4-7; dst d holds 2d, 2d+1.
  dst 0 <- src 0[0:2], dst 1 <- src 0[2:4], dst 2 <- src 1[0:2], dst 3 <- src 1[2:4].
* kv=8, a=4 -> b=1: dst 0 holds 0-7 and receives src r[0:2] into [2r:2r+2], r=0..3.
* kv=2, a=1 -> b=4 (replication): src 0 holds 0-1; dst 0,1 hold head 0 and
  dst 2,3 head 1; dst d <- src 0[d//2 : d//2+1] into [0:1].

Tie-break when a head is held by several source ranks (source replication): the
holders of head ``h`` are a contiguous rank range; destination rank ``d`` takes
``holders[d % len(holders)]``. This is round-robin over destination ranks, gives
the identity mapping when ``a == b``, and spreads the reads over every replica.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

MAX_TP_SIZE = 64
MAX_KV_HEADS = 1 << 16


class TopologyMismatch(ValueError):
    """The source and destination KV topologies cannot be mapped onto each other."""


def _checked_int(name: str, value: Any, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"KV topology {name} must be an int, got {type(value).__name__} {value!r:.40}")
    if not lo <= value <= hi:
        raise ValueError(f"KV topology {name}={value} is out of range [{lo}, {hi}]")
    return value


@dataclass(frozen=True)
class KVTopology:
    """TP size of a node and the model's TOTAL number of KV heads."""

    tp_size: int
    num_kv_heads: int

    def __post_init__(self) -> None:
        _checked_int("tp_size", self.tp_size, 1, MAX_TP_SIZE)
        _checked_int("num_kv_heads", self.num_kv_heads, 1, MAX_KV_HEADS)

    def check(self) -> None:
        """Raise ValueError unless the heads split evenly (or replicate evenly) over the ranks."""
        kv, tp = self.num_kv_heads, self.tp_size
        if kv % tp and tp % kv:
            raise ValueError(f"{kv} KV heads cannot be split over TP size {tp}: neither divides the other")

    def heads_of(self, rank: int) -> range:
        """Global KV heads held by ``rank`` (as shard_sizes: replicated when kv < tp)."""
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank!r} is not in [0, {self.tp_size})")
        start = rank * self.num_kv_heads // self.tp_size
        return range(start, start + max(1, self.num_kv_heads // self.tp_size))

    def holders_of(self, head: int) -> range:
        """Ranks that hold global KV ``head`` (several when heads are replicated); needs check()."""
        if not 0 <= head < self.num_kv_heads:
            raise ValueError(f"KV head {head!r} is not in [0, {self.num_kv_heads})")
        kv, tp = self.num_kv_heads, self.tp_size
        if tp >= kv:
            per = tp // kv
            return range(head * per, head * per + per)
        return range(head * tp // kv, head * tp // kv + 1)

    def to_dict(self) -> dict[str, int]:
        return {"tp_size": self.tp_size, "num_kv_heads": self.num_kv_heads}

    @classmethod
    def from_dict(cls, d: Any) -> KVTopology:
        """Inverse of to_dict; ValueError on anything but a mapping of two in-range ints (extra keys ignored)."""
        if not isinstance(d, Mapping):
            raise ValueError(f"KV topology must be a mapping, got {type(d).__name__}")
        missing = [k for k in ("tp_size", "num_kv_heads") if k not in d]
        if missing:
            raise ValueError(f"KV topology is missing {', '.join(missing)}")
        return cls(tp_size=d["tp_size"], num_kv_heads=d["num_kv_heads"])


@dataclass(frozen=True)
class Route:
    """Copy ``src[..., src_heads, :]`` of ``src_rank`` into ``dst[..., dst_heads, :]`` of ``dst_rank``."""

    src_rank: int
    dst_rank: int
    src_heads: slice  # local head indices in the source rank's cache
    dst_heads: slice  # local head indices in the destination rank's cache
    heads: range  # the global KV heads moved


def plan(src: KVTopology, dst: KVTopology) -> list[Route]:
    """Routes, ordered by destination rank then head, delivering every destination head exactly once."""
    if src.num_kv_heads != dst.num_kv_heads:
        raise TopologyMismatch(
            f"total KV heads differ: source (prefill, tp={src.tp_size}) has {src.num_kv_heads}, "
            f"destination (decode, tp={dst.tp_size}) has {dst.num_kv_heads}"
        )
    for side, topo in (("source (prefill)", src), ("destination (decode)", dst)):
        try:
            topo.check()
        except ValueError as e:
            raise TopologyMismatch(
                f"{side} split is invalid: {e} (source tp={src.tp_size}, destination tp={dst.tp_size})"
            ) from e
    routes: list[Route] = []
    for d in range(dst.tp_size):
        held = dst.heads_of(d)
        runs: list[list[int]] = []  # [source rank, first head, stop head], merged while the source repeats
        for h in held:
            holders = src.holders_of(h)
            s = holders[d % len(holders)]
            if runs and runs[-1][0] == s:
                runs[-1][2] = h + 1
            else:
                runs.append([s, h, h + 1])
        for s, lo, hi in runs:
            first = src.heads_of(s).start
            routes.append(Route(src_rank=s, dst_rank=d, src_heads=slice(lo - first, hi - first),
                                dst_heads=slice(lo - held.start, hi - held.start), heads=range(lo, hi)))
    return routes


def routes_from(src_rank: int, routes: list[Route]) -> list[Route]:
    """The routes a source rank must send."""
    return [r for r in routes if r.src_rank == src_rank]


def routes_to(dst_rank: int, routes: list[Route]) -> list[Route]:
    """The routes a destination rank receives."""
    return [r for r in routes if r.dst_rank == dst_rank]
