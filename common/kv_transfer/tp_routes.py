"""A decode rank's loads from a prefill node of a larger tensor-parallel size (``tp_ranks``).

With prefill TP ``a`` = k · decode TP ``b`` (``kv_topology.plan``), decode rank d holds the heads
of prefill ranks d·k .. d·k + k − 1: each of those ranks sends all of its heads, and they land
in one slice of d's heads. So a load becomes k routes, each an ordinary one-rank transfer:

* each route has a consumer of its own (:class:`RankRoutes` opens one per head slice, once): a
  ``KVEndpoint`` whose layout is the slice's and whose cache is a view of this rank's
  cache at those heads. The prefill rank sees a consumer of its own layout and needs no change;
  the receive goes through a staging buffer (the view is not contiguous), then into the blocks;
* the routes' outcomes become this rank's one outcome with :class:`~tp_outcomes.RankOutcomes`, as the
  ranks' do on rank 0: landed when every route landed (the first token is the first route's),
  failed with the first route's reason once no route can still write into the blocks.

The other way (a < b: a prefill rank's heads split over several decode ranks) needs a prefill
rank to send part of its heads, to more than one puller: not built, and the proxy does not pair
those (``proxy/routing.heads_route``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.engine.kv_connector import FinishedTransfers, KVConnectorMetadata, KVConnectorWorker, LoadSpec
from common.kv_topology import KVTopology, Route, plan, routes_to
from common.kv_transfer.tp_outcomes import RankOutcomes
from common.kv_transfer.workers import ConsumerWorker

if TYPE_CHECKING:
    import torch

    from common.kv_layout import KVLayout
    from common.kv_transfer.endpoint import KVEndpoint

log = logging.getLogger(__name__)


def rank_address(address: str, rank: int) -> str:
    """``host:port`` of the same peer's rank ``rank``: ``host:(port + rank)``."""
    host, _, port = address.rpartition(":")
    return f"{host}:{int(port) + rank}"


def merge(a: FinishedTransfers, b: FinishedTransfers) -> FinishedTransfers:
    """Two reports about different requests, as one."""
    return FinishedTransfers(
        freeable=a.freeable | b.freeable, stopped=a.stopped | b.stopped,
        done_recving={**a.done_recving, **b.done_recving}, first_logprobs={**a.first_logprobs, **b.first_logprobs},
        choice_firsts={**a.choice_firsts, **b.choice_firsts}, cached_tokens={**a.cached_tokens, **b.cached_tokens},
        failed_recving={**a.failed_recving, **b.failed_recving})


class RankRoutes:
    """This decode rank's routed loads: their consumers (one per head slice) and their outcomes."""

    def __init__(self, rank: int, tp_size: int, num_kv_heads: int, layout: KVLayout, kv_caches: list[torch.Tensor],
                 open_engine: Callable[[KVLayout], KVEndpoint]) -> None:
        """``num_kv_heads``: the model's; ``layout`` and ``kv_caches``: this rank's."""
        self.rank, self.tp_size, self.num_kv_heads = rank, tp_size, num_kv_heads
        self.layout, self.kv_caches = layout, kv_caches
        self.open_engine = open_engine
        self.workers: dict[tuple[int, int], ConsumerWorker] = {}  # (first head, stop) -> its consumer
        self.loads: dict[str, list[tuple[int, ConsumerWorker]]] = {}  # request -> (prefill rank, consumer) per route
        self.outcomes = RankOutcomes(1)  # over a load's routes, by their index
        self.refused: dict[str, str] = {}  # loads no route could take: reported failed at the next poll

    def routed(self, load: LoadSpec) -> bool:
        """Does ``load`` come from a prefill node of another TP size?"""
        return load.src_tp not in (0, self.tp_size)

    def routes(self, src_tp: int) -> list[Route]:
        return routes_to(self.rank, plan(KVTopology(src_tp, self.num_kv_heads),
                                         KVTopology(self.tp_size, self.num_kv_heads)))

    def _worker(self, heads: slice) -> ConsumerWorker:
        key = (heads.start, heads.stop)
        if key not in self.workers:
            layout = dataclasses.replace(self.layout, num_kv_heads=heads.stop - heads.start)
            worker = ConsumerWorker()
            worker.bind(self.open_engine(layout), [c[:, :, :, heads] for c in self.kv_caches])
            self.workers[key] = worker
            log.info("rank %d: a consumer for KV heads %d..%d of its %d (routes from a prefill node of another "
                     "TP size)", self.rank, heads.start, heads.stop - 1, self.layout.num_kv_heads)
        return self.workers[key]

    def split(self, meta: KVConnectorMetadata, consumer, peer_tp_size: Callable[[str], int],
              ) -> tuple[KVConnectorMetadata, list[LoadSpec]]:
        """``meta`` for this rank's own endpoint (``consumer``), and the loads the routes take
        instead: from a prefill node of another TP size that this rank may pull from. Their aborts
        and releases are carried out here (a release's TP size is its third item, or
        ``peer_tp_size``'s). The table's record of a routed load stands for all of its routes."""
        routed = [s for s in meta.loads if self.routed(s) and consumer.known_peer(s.prefill_addr)]
        aborts = []
        for rid in meta.aborts:
            if rid in self.loads:
                self.abort(rid)
            else:
                aborts.append(rid)
        releases = []
        for rid, addr, *rest in meta.releases:
            src_tp = rest[0] if rest else peer_tp_size(addr)
            if src_tp in (0, self.tp_size):
                releases.append((rid, addr))
            else:
                self.release(rid, addr, src_tp, consumer.release_remote)
        own = dataclasses.replace(meta, loads=tuple(s for s in meta.loads if s not in routed), aborts=tuple(aborts),
                                  releases=tuple(releases))
        for load in routed:
            self.load(load)
        return own, routed

    def load(self, load: LoadSpec) -> None:
        """Ask each route's prefill rank for its heads (``load.prefill_addr`` is the node's rank 0);
        a pairing the routes cannot move fails the request alone (``refused``)."""
        rid = load.request_id
        routes = self.routes(load.src_tp)
        src = KVTopology(load.src_tp, self.num_kv_heads)
        if any(len(r.heads) != len(src.heads_of(r.src_rank)) for r in routes):  # part of a prefill rank's heads
            self.refused[rid] = (f"prefill TP {load.src_tp} to decode TP {self.tp_size}: a prefill rank's heads "
                                 "would split over decode ranks, which is not built")
            return
        parts = []
        for route in routes:
            worker = self._worker(route.dst_heads)
            table = worker.transfer.consumer.table
            table.load_pending(rid)
            table.issue(rid)
            addr = rank_address(load.prefill_addr, route.src_rank)
            worker.issue(KVConnectorMetadata(loads=(dataclasses.replace(load, prefill_addr=addr),)))
            parts.append((route.src_rank, worker))
        self.loads[rid] = parts
        self.outcomes.expect_load(rid, frozenset(range(len(parts))))

    def abort(self, request_id: str, by_scheduler: bool = True) -> None:
        """Stop every route of the load that may still receive; ``by_scheduler``: it ends "stopped"."""
        if by_scheduler:
            self.outcomes.aborted(request_id)
        for _, worker in self.loads.get(request_id, ()):
            if worker.transfer.consumer.table.abort(request_id):
                worker.issue(KVConnectorMetadata(aborts=(request_id,)))

    def release(self, request_id: str, prefill_addr: str, src_tp: int, send: Callable[[str, str], None]) -> None:
        """Tell each of this rank's prefill ranks to drop a request it will not be asked for."""
        for src in sorted({r.src_rank for r in self.routes(src_tp)}):
            send(request_id, rank_address(prefill_addr, src))

    def get_finished(self) -> FinishedTransfers:
        """The routed loads that ended since the last call, one outcome each."""
        refused, self.refused = self.refused, {}
        if not self.workers:
            return FinishedTransfers(failed_recving=refused)
        polled = {}
        for worker in self.workers.values():
            f = polled[id(worker)] = worker.get_finished()
            worker.transfer.consumer.table.forget((*f.done_recving, *f.failed_recving), f.stopped)
        reports = [FinishedTransfers() for _ in range(max((len(p) for p in self.loads.values()), default=0))]
        for rid, parts in self.loads.items():
            for i, (src, worker) in enumerate(parts):
                f, rep = polled[id(worker)], reports[i]
                if rid in f.done_recving:
                    rep.done_recving[rid] = f.done_recving[rid]
                    for name in ("first_logprobs", "choice_firsts", "cached_tokens"):
                        if rid in (extras := getattr(f, name)):
                            getattr(rep, name)[rid] = extras[rid]
                if rid in f.failed_recving:
                    rep.failed_recving[rid] = f"the route from prefill rank {src}: {f.failed_recving[rid]}"
                if rid in f.stopped:
                    rep.stopped.add(rid)
        out, to_stop = self.outcomes.combine(reports)
        for rid in (*out.done_recving, *out.failed_recving, *out.stopped):
            self.loads.pop(rid, None)
        for rid in to_stop:
            self.abort(rid, by_scheduler=False)
        out.failed_recving.update(refused)
        return out

    def close(self) -> None:
        for worker in self.workers.values():
            worker.transfer.close()


class RoutedWorker(KVConnectorWorker):
    """A one-rank decode node's connector worker: its endpoint's (``inner``), and routes for the
    loads from a prefill node of a larger TP size (a multi-rank node's is ``tp_ranks.LeaderKVWorker``)."""

    def __init__(self, inner: ConsumerWorker, routes: RankRoutes, peer_tp_size: Callable[[str], int]) -> None:
        self.inner, self.routes, self.peer_tp_size = inner, routes, peer_tp_size

    def issue(self, meta: KVConnectorMetadata) -> None:
        own, _ = self.routes.split(meta, self.inner.consumer, self.peer_tp_size)
        self.inner.issue(own)

    def get_finished(self) -> FinishedTransfers:
        return merge(self.inner.get_finished(), self.routes.get_finished())
