"""Each rank's KV endpoint under tensor parallelism: how rank 0 has the workers open theirs
(``KV_START``), what a worker opens (its endpoint, or its KV ranks' with ``--kv-ranks``; its
routes on a decode node), and how a worker serves the KV commands rank 0 broadcasts
(:class:`RankKVServer`, the engine's ``RankExtension`` that ``tp_rank_main`` installs)."""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgpack

from common.engine.kv_connector import FinishedTransfers
from common.engine.model_runner import LayerHook
from common.engine.parallel import Leader
from common.engine.tp_worker import RankExtension, WorkerRank
from common.kv_transfer.tp_ranks import (KV_ISSUE, KV_MEMBERS, KV_POLL, KV_START, RankFollower, decode_member_list,
                                         decode_meta, encode_report)
from common.kv_transfer.tp_routes import RankRoutes
from common.kv_transfer.tp_slices import SlicedWorker, slice_caches, slice_heads, slice_layout
from common.kv_transfer.workers import ConsumerWorker, ProducerWorker

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


def endpoint_spec(role: str, host: str, port: int, advertise_host: str | None, transport: str,
                  key_file: str | None, config: object, vocab_size: int, slices: int = 1) -> bytes:
    """What a worker needs to open its rank's endpoint (KV_START's payload); ``slices``: KV ranks
    per rank (``tp_slices``)."""
    return json.dumps({"role": role, "host": host, "port": port, "advertise_host": advertise_host,
                       "transport": transport, "key_file": key_file, "config": dataclasses.asdict(config),
                       "vocab_size": vocab_size, "slices": slices}).encode()


def view_transport(device: str, transport: str) -> str:
    """``--kv-transport`` for an endpoint over a view of some of a cache's heads: cuda_ipc maps
    the cache exported at its handshake, not a view, so on CUDA such an endpoint uses NCCL."""
    return "nccl" if device.startswith("cuda") and transport in ("auto", "cuda_ipc") else transport


def engine_opener(spec: dict, device: str, stats, own_address: str = "") -> Callable:
    """How a rank opens an endpoint over part of its heads (a route's consumer, ``tp_routes``; a KV
    rank's producer, ``tp_slices``): ``open_engine(layout, port=0)`` (0: any free port, as for a
    consumer, which nobody dials), sharing the rank's counters, on ``view_transport``.

    Such a consumer names ``own_address`` (its rank's KV address) in its handshakes, not its own
    port: a keyless prefill node gives its pair slots to the addresses the registry lists first,
    one per decode rank, and would take a route's pair for a stranger's."""
    from common.cluster_auth import ClusterKey
    from common.kv_transfer.config import TransferConfig
    from common.kv_transfer.endpoint import KVEndpoint

    transport = view_transport(device, spec["transport"])

    def open_engine(layout, port: int = 0):
        engine = KVEndpoint(f"{spec['host']}:{port}", layout, TransferConfig(**spec["config"]), stats,
                                  device=device, advertise_host=spec["advertise_host"], transport=transport,
                                  key=ClusterKey.optional(spec["key_file"]), vocab_size=spec["vocab_size"],
                                  role=spec["role"])
        if port == 0 and own_address:
            engine.consumer.address = own_address
        return engine

    return open_engine


def kv_rank_workers(first: ProducerWorker, k: int, port: int, layout, kv_caches: list[torch.Tensor],
                    open_engine: Callable) -> SlicedWorker:
    """A prefill rank's ``k`` KV ranks (``tp_slices``): ``first`` is bound to the first slice's
    endpoint already; the others open at ``port + 1 .. port + k - 1``. ``layout``: the rank's."""
    workers = [first]
    for j in range(1, k):
        worker = ProducerWorker()
        worker.bind(open_engine(slice_layout(layout, k), port + j),
                    slice_caches(kv_caches, slice_heads(layout.num_kv_heads, k, j)))
        workers.append(worker)
    return SlicedWorker(workers, layout.num_kv_heads)


def open_rank_endpoint(spec: bytes, rank: int, size: int, num_kv_heads: int, layout, device: str,
                       kv_caches: list[torch.Tensor]) -> RankFollower:
    """A worker's side of KV_START: its endpoint (its first KV rank's) at ``port + rank · k``, with
    its own heads' layout (``k`` KV ranks a rank: each a slice of its heads, ``tp_slices``)."""
    from common.cluster_auth import ClusterKey
    from common.kv_transfer.config import TransferConfig, TransferStats
    from common.kv_transfer.endpoint import KVEndpoint

    s = json.loads(spec)
    stats, k = TransferStats(), s.get("slices", 1)
    port = s["port"] + rank * k
    opener = engine_opener(s, device, stats, f"{s['advertise_host'] or s['host']}:{port}")
    if k > 1:
        first = ProducerWorker()
        first.bind(opener(slice_layout(layout, k), port), slice_caches(kv_caches, slice_heads(layout.num_kv_heads, k, 0)))
        worker = kv_rank_workers(first, k, port, layout, kv_caches, opener)
        return RankFollower(s["role"], rank, first.transfer, worker)
    transfer = KVEndpoint(f"{s['host']}:{port}", layout, TransferConfig(**s["config"]),
                                stats, device=device, advertise_host=s["advertise_host"],
                                transport=s["transport"], key=ClusterKey.optional(s["key_file"]),
                                vocab_size=s["vocab_size"], role=s["role"])
    worker = ProducerWorker() if s["role"] == "prefill" else ConsumerWorker()
    worker.bind(transfer, kv_caches)
    routes = None
    if s["role"] == "decode":
        routes = RankRoutes(rank, size, num_kv_heads, layout, kv_caches, opener)
    return RankFollower(s["role"], rank, transfer, worker, routes)


def start_rank_endpoints(leader: Leader, spec: bytes) -> None:
    """Rank 0: every worker opens its rank's KV endpoint; raises RuntimeError naming the ranks that
    could not (a port taken, say)."""
    leader.send_bytes(KV_START, spec)
    replies = leader.gather_bytes(b"")[1:]
    errors = [f"rank {rank}: {r.decode()}" for rank, r in enumerate(replies, start=1) if r]
    if errors:
        raise RuntimeError("a tensor-parallel rank could not open its KV endpoint: " + "; ".join(errors))


class RankKVServer(RankExtension):
    """A worker rank's KV part: KV_START opens its endpoint (``open_rank_endpoint``; the outcome is
    gathered by rank 0), KV_ISSUE, KV_POLL and KV_MEMBERS go to its :class:`RankFollower`, and each
    step saves what the follower was told to."""

    def __init__(self, worker: WorkerRank) -> None:
        super().__init__(worker)
        self.follower: RankFollower | None = None  # once KV_START opened this rank's endpoint

    def command(self, op: int, payload: bytes) -> None:
        if op == KV_START:
            self._start(payload)
        elif op == KV_ISSUE:
            if self.follower is not None:
                self.follower.issue(decode_meta(payload))
        elif op == KV_MEMBERS:
            if self.follower is not None:
                self.follower.set_members(decode_member_list(payload))
        elif op == KV_POLL:
            self.worker.group.gather_bytes(self.follower.poll() if self.follower is not None else msgpack.packb(
                [{}, encode_report(FinishedTransfers())]))
        else:
            super().command(op, payload)

    def _start(self, spec: bytes) -> None:
        w = self.worker
        try:
            self.follower = open_rank_endpoint(spec, w.rank, w.size, w.model_config.num_kv_heads, w.runner.kv_layout,
                                               str(w.device), w.runner.kv_caches)
            reply = b""
        except Exception as exc:  # reported to rank 0, which fails its start with it
            log.exception("could not open this rank's KV endpoint")
            reply = f"{type(exc).__name__}: {exc}".encode()
        w.group.gather_bytes(reply)

    def step_hook(self) -> LayerHook | None:
        return self.follower.step_hook() if self.follower is not None else None

    def close(self) -> None:
        if self.follower is not None:
            self.follower.close()
