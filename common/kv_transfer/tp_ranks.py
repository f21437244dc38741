"""KV transfer under tensor parallelism: every rank moves its own heads, rank 0 gives one outcome.

A prefill or decode node of ``N`` ranks opens one KV endpoint per rank: rank 0's at
``--kv-port`` (the one the proxy and the request ids name), rank r's at ``kv-port + r``
(``KV_START``, sent once by rank 0 when its own endpoint is up; ``tp_endpoints``). At equal
TP sizes rank r of a decode node pulls from rank r of the prefill node: both hold the same KV
heads, so each rank pair is an ordinary one-rank transfer of that rank's slice of the heads,
over its own data-plane pair. Other sizes go through routes (``tp_routes``: a larger prefill
node) or KV ranks (``tp_slices``: a smaller one, with ``--kv-ranks``). No rank gathers another
rank's KV.

Rank 0 keeps the scheduler and the connector's scheduler side: one record per request in
its table. Block ids are the same on every rank (rank 0 decides and broadcasts them). The
worker side of rank 0 is a :class:`LeaderKVWorker`:

* ``issue(meta)``: carried out on rank 0's endpoint and broadcast to the workers
  (``KV_ISSUE``), whose :class:`RankFollower` carries it out on theirs, with the table calls
  rank 0's scheduler side makes, at the addresses of the peer's same rank.
* ``save_kv_layer``: each rank saves its own layers in its own forward.
* ``get_finished()``: rank 0 polls its endpoint and gathers every worker's report
  (``KV_POLL``); :class:`~tp_outcomes.RankOutcomes` turns them into one outcome per request.

* membership (prefill, keyless): which consumers are registered decode nodes, whose pairs a
  stranger's never keeps out of a slot (``KVProducer.is_member``). Rank 0 learns the list from
  the registry; ``get_finished`` forwards it (``KV_MEMBERS``) whenever it changed, and each
  worker's producers answer from it by rank 0's rule (:func:`counts_as_member`).

The four commands are the engine's extension commands (``parallel.FIRST_EXTENSION_OP`` on):
the workers run ``tp_rank_main``, which serves them (``tp_endpoints.RankKVServer``).

One outcome (``tp_outcomes``):

* decode: a request landed when every rank's part landed (the first token is rank 0's).
  The first rank that fails makes it fail once, with that rank's reason; every other rank
  still receiving is aborted, and the failure is reported only when no rank can write into
  the blocks any more, so the scheduler frees them once for all ranks. While any rank may
  still write, rank 0's table counts the load as receiving (an abort holds the blocks).
* prefill: the blocks are freeable when every rank released its part (acknowledged,
  aborted, failed or its lease ended: each rank's own lease bounds the wait).

A rank that dies stops its node (``parallel.Leader``): its peers' transfers fail by their
timeouts, and the proxy stops routing to a node that no longer heartbeats.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgpack

from common.engine.kv_connector import (EMPTY_METADATA, DiscardSpec, FinishedTransfers, HandoverSpec,
                                        KVConnectorMetadata, KVConnectorWorker, LoadSpec, SaveSpec)
from common.engine.parallel import FIRST_EXTENSION_OP, Leader
from common.kv_transfer.consumer_table import ConsumerState
from common.kv_transfer.tp_outcomes import RankOutcomes
from common.kv_transfer.tp_routes import RankRoutes, merge, rank_address
from common.kv_transfer.tp_slices import SlicedWorker
from common.kv_transfer.workers import consumer_of

if TYPE_CHECKING:
    import torch

    from common.kv_transfer.endpoint import KVEndpoint

log = logging.getLogger(__name__)

# rank 0's commands to the workers: open your KV endpoint, carry out this metadata, report what ended,
# these consumers are members
KV_START, KV_ISSUE, KV_POLL, KV_MEMBERS = range(FIRST_EXTENSION_OP, FIRST_EXTENSION_OP + 4)


# ---- what crosses the tensor-parallel group --------------------------------------------------
def encode_meta(meta: KVConnectorMetadata) -> bytes:
    return msgpack.packb([[dataclasses.astuple(s) for s in meta.loads], [dataclasses.astuple(s) for s in meta.saves],
                          [dataclasses.astuple(s) for s in meta.handovers],
                          [dataclasses.astuple(s) for s in meta.discards], list(meta.aborts),
                          [list(r) for r in meta.releases]])


def decode_meta(data: bytes) -> KVConnectorMetadata:
    loads, saves, handovers, discards, aborts, releases = msgpack.unpackb(data)
    return KVConnectorMetadata(
        tuple(LoadSpec(*s) for s in loads), tuple(SaveSpec(*s) for s in saves),
        tuple(HandoverSpec(*s) for s in handovers), tuple(DiscardSpec(*s) for s in discards),
        tuple(aborts), tuple(tuple(r) for r in releases))


def encode_report(f: FinishedTransfers) -> bytes:
    """A worker's part of a poll: which of its transfers ended, and how."""
    return msgpack.packb({"freeable": sorted(f.freeable), "stopped": sorted(f.stopped),
                          "done": sorted(f.done_recving), "failed": f.failed_recving})


def decode_report(data: bytes) -> FinishedTransfers:
    r = msgpack.unpackb(data)
    return FinishedTransfers(freeable=set(r["freeable"]), stopped=set(r["stopped"]),
                             done_recving=dict.fromkeys(r["done"], 0), failed_recving=dict(r["failed"]))


def encode_member_list(members: frozenset[str] | None) -> bytes:
    """KV_MEMBERS' payload: the members' KV addresses, or None (every consumer counts)."""
    return msgpack.packb(None if members is None else sorted(members))


def decode_member_list(data: bytes) -> frozenset[str] | None:
    members = msgpack.unpackb(data)
    return None if members is None else frozenset(members)


def counts_as_member(members: frozenset[str] | None, consumer: str) -> bool:
    """Is the pair of the consumer at ``consumer`` a member's? ``members``: the registered decode
    nodes' KV addresses (one per KV rank: a decode rank r handshakes from its node's port + r), or
    None when every consumer counts (a cluster key, or no registry answer yet): the daemon's
    ``member_decode`` rule (common/node/daemon.py), which rank 0's own endpoint uses."""
    return members is None or consumer in members


def for_rank(meta: KVConnectorMetadata, rank: int) -> KVConnectorMetadata:
    """``meta`` with each peer address moved to that peer's rank ``rank``."""
    if rank == 0:
        return meta
    return dataclasses.replace(
        meta,
        loads=tuple(dataclasses.replace(s, prefill_addr=rank_address(s.prefill_addr, rank)) for s in meta.loads),
        saves=tuple(dataclasses.replace(s, decode_addr=rank_address(s.decode_addr, rank)) for s in meta.saves),
        handovers=tuple(dataclasses.replace(s, decode_addr=rank_address(s.decode_addr, rank))
                        for s in meta.handovers),
        releases=tuple((rid, rank_address(addr, rank), *rest) for rid, addr, *rest in meta.releases))


# ---- rank 0 -------------------------------------------------------------------------------------
class LeaderKVWorker(KVConnectorWorker):
    """Rank 0's connector worker under tensor parallelism: its own endpoint's worker
    (``inner``), its routed loads (``routes``, decode), the workers told every decision, and
    their reports combined.

    ``members`` (prefill): the decode nodes' KV addresses the registry last named, or None when
    every consumer counts (the daemon's ``decode_members``); forwarded to the workers' endpoints
    when it changes. A worker endpoint starts at None, as rank 0's producer starts with every
    consumer a member, so nothing is sent until the registry has answered."""

    def __init__(self, inner: KVConnectorWorker, leader: Leader, role: str,
                 routes: RankRoutes | None = None, peer_tp_size=lambda addr: 0,
                 members: Callable[[], frozenset[str] | None] = lambda: None) -> None:
        self.inner, self.leader, self.role, self.routes = inner, leader, role, routes
        self.peer_tp_size = peer_tp_size  # a prefill node's TP size (0: unknown), for releases
        self.members = members
        self._members_read: frozenset[str] | None = None  # members()'s last answer, to skip comparing it
        self._members_sent: frozenset[str] | None = None  # what the workers' endpoints were told
        self.outcomes = RankOutcomes(leader.size)
        self.rank_stats: list[dict] = [{} for _ in range(leader.size)]  # each worker's transfer counters

    def issue(self, meta: KVConnectorMetadata) -> None:
        for rid in meta.aborts:
            self.outcomes.aborted(rid)
        own, routed = meta, []
        if self.routes is not None:
            own, routed = self.routes.split(meta, consumer_of(self.inner), self.peer_tp_size)
        self.inner.issue(own)
        refused = self._refused(own) | {s.request_id for s in routed if s.request_id in self.routes.refused}
        for load in meta.loads:  # refused at once on rank 0 (unknown peer, bad request): no worker asks
            self.outcomes.expect_load(load.request_id, frozenset({0}) if load.request_id in refused else None)
        for h in meta.handovers:
            self.outcomes.expect_release(h.request_id)
        # a release naming a prefill node rank 0 would not pull from is not forwarded: the workers'
        # consumers know no peers of their own, and an unverified id may name any address
        known = consumer_of(self.inner).known_peer if meta.releases else None
        meta = dataclasses.replace(
            meta, loads=tuple(s for s in meta.loads if s.request_id not in refused),
            releases=tuple((rid, addr, self.peer_tp_size(addr)) for rid, addr, *_ in meta.releases if known(addr)))
        if meta:
            self.leader.send_bytes(KV_ISSUE, encode_meta(meta))

    def _refused(self, meta: KVConnectorMetadata) -> set[str]:
        """The loads rank 0 refused as it issued them (a bad request, an unknown peer): the workers
        must not ask that peer either. This is what keeps a decode node's worker ranks, whose
        consumers keep ``known_peer``'s default (any address), from pulling from a prefill node rank 0
        does not know: rank 0's consumer refuses it before opening anything (``KVConsumer.request``,
        FAILED in its table; a routed load is taken only from a known peer, ``RankRoutes.split``),
        and a refused load is left out of KV_ISSUE."""
        if not meta.loads:
            return set()
        table = consumer_of(self.inner).table
        return {s.request_id for s in meta.loads if table.state(s.request_id) is ConsumerState.FAILED}

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, meta: KVConnectorMetadata) -> None:
        self.inner.save_kv_layer(layer_idx, kv_layer, meta)

    def get_finished(self) -> FinishedTransfers:
        self._forward_members()
        own = self.inner.get_finished()
        if self.routes is not None:
            own = merge(own, self.routes.get_finished())
        if not self.outcomes.pending:  # no worker's report could settle anything: no collective round trip
            return self.outcomes.combine([own])[0]
        self.leader.send(KV_POLL)
        parts = self.leader.gather_bytes(b"")[1:]
        reports = [own]
        for rank, part in enumerate(parts, start=1):
            stats, report = msgpack.unpackb(part)
            self.rank_stats[rank] = stats
            reports.append(decode_report(report))
        out, to_stop = self.outcomes.combine(reports)
        if to_stop:
            log.warning("stopping the other ranks' parts of %d transfer(s) a rank failed: %s", len(to_stop), to_stop)
            stop = KVConnectorMetadata(aborts=tuple(to_stop))
            for rid in to_stop:
                if self.routes is not None and rid in self.routes.loads:
                    self.routes.abort(rid, by_scheduler=False)
            mine = tuple(r for r in to_stop if self.routes is None or r not in self.routes.loads)
            self.inner.issue(_held_aborts(KVConnectorMetadata(aborts=mine), self.inner))
            self.leader.send_bytes(KV_ISSUE, encode_meta(stop))
        return out

    def _forward_members(self) -> None:
        """Send the workers ``members()`` if it changed since they were last told (KV_MEMBERS). Runs
        at each poll on the engine thread, which owns the group: a change reaches the workers at the
        next step (an idle engine polls nothing: at its next request's first step)."""
        members = self.members()
        if members is self._members_read:  # the registry client keeps one set until a heartbeat's answer
            return
        self._members_read = members
        if members != self._members_sent:
            self._members_sent = members
            self.leader.send_bytes(KV_MEMBERS, encode_member_list(members))


def _held_aborts(meta: KVConnectorMetadata, worker: KVConnectorWorker) -> KVConnectorMetadata:
    """Of ``meta.aborts``, those that may still receive on this rank (the table moves them to ABORTING),
    as the scheduler side keeps only those."""
    table = consumer_of(worker).table
    return dataclasses.replace(meta, aborts=tuple(rid for rid in meta.aborts if table.abort(rid)))


# ---- a worker rank ------------------------------------------------------------------------------
class RankFollower:
    """A worker rank's part: rank 0's decisions carried out on this rank's own KV endpoint and
    cache (and its routes, on a decode node), with the table calls rank 0's scheduler side makes.
    On a prefill node its producers' pair slots go to members first by rank 0's list (KV_MEMBERS)."""

    def __init__(self, role: str, rank: int, transfer: KVEndpoint, worker: KVConnectorWorker,
                 routes: RankRoutes | None = None) -> None:
        """``transfer``: the rank's (first) endpoint, whose table the follower keeps; ``worker``: bound
        to it (or a ``SlicedWorker`` over the rank's KV ranks, whose others ask the first's is_member)."""
        self.role, self.rank, self.transfer, self.worker, self.routes = role, rank, transfer, worker, routes
        self._saves = EMPTY_METADATA  # the metadata whose saves the next step makes
        self.members: frozenset[str] | None = None  # rank 0's last KV_MEMBERS; None: every consumer counts
        if role == "prefill":
            transfer.producer.is_member = self.is_member

    def is_member(self, consumer: str) -> bool:
        """The producer's question (control thread): does ``consumer`` name a registered decode node?"""
        return counts_as_member(self.members, consumer)

    def set_members(self, members: frozenset[str] | None) -> None:
        """KV_MEMBERS: rank 0's member list changed (one assignment: the control thread reads it unlocked)."""
        self.members = members
        if members is None:
            log.info("rank %d: every consumer's pair counts as a member's", self.rank)
        else:
            log.info("rank %d: %d registered decode KV address(es) are members; other consumers' pairs are "
                     "strangers'", self.rank, len(members))

    def issue(self, meta: KVConnectorMetadata) -> None:
        if self.role == "decode":
            meta = self._route(meta)
            meta = for_rank(meta, self.rank)
            table = self.transfer.consumer.table
            for load in meta.loads:
                table.load_pending(load.request_id)
                table.issue(load.request_id)
            meta = _held_aborts(meta, self.worker)
        else:
            meta = for_rank(meta, self.rank)
            for h in meta.handovers:
                self.transfer.producer.table.hand_over(h.request_id)
        self.worker.issue(meta)
        if meta.saves:
            self._saves = meta

    def _route(self, meta: KVConnectorMetadata) -> KVConnectorMetadata:
        """Carry out what concerns a prefill node of another TP size on this rank's routes; the
        rest is for its own endpoint."""
        if self.routes is None:
            return meta
        own, _ = self.routes.split(meta, self.transfer.consumer, lambda addr: 0)
        return own

    def step_hook(self):
        """The per-layer save hook of the step about to run (None: it saves nothing)."""
        meta, self._saves = self._saves, EMPTY_METADATA
        if not meta.saves:
            return None
        return lambda layer_idx, kv_layer: self.worker.save_kv_layer(layer_idx, kv_layer, meta)

    def poll(self) -> bytes:
        """This rank's report for rank 0: its transfer counters and what ended since the last poll."""
        finished = self.worker.get_finished()
        if self.role == "decode":
            self.transfer.consumer.table.forget((*finished.done_recving, *finished.failed_recving), finished.stopped)
            if self.routes is not None:
                finished = merge(finished, self.routes.get_finished())
        else:
            self.transfer.producer.table.forget(finished.freeable)
        stats = self.transfer.stats.snapshot()
        return msgpack.packb([stats, encode_report(finished)])

    def close(self) -> None:
        if self.routes is not None:
            self.routes.close()
        if isinstance(self.worker, SlicedWorker):
            self.worker.close()
        self.transfer.close()
