"""What the prefill and decode daemons share: a serving node plus a KV transfer endpoint,
registration with every proxy (common/proxy_heartbeats.py), and transfer metrics.

Start-up, top to bottom (``started_daemon``, then the role's ``serve``): logging -> the HTTP and
KV ports and the device checked -> the engine (model, KV cache) -> the KV endpoint (bound at
``host:kv_port``, reached by peers at ``kv_host:kv_port``) handed to the connector ->
heartbeats to every proxy -> the role's HTTP app (its hooks and middleware, then the signed-id
check outermost) -> HTTP. Shut-down runs the other way: HTTP drains, the engine stops calling
the connector, then heartbeats stop and the KV endpoint closes its threads and sockets.
"""

from __future__ import annotations

import json
import logging
import socket
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

from fastapi import FastAPI
from prometheus_client import Gauge

from common.cluster_auth import ClusterKey, warn_if_open
from common.config import NodeConfig
from common.metrics import PREFIX, NodeMetrics
from common.node.node import check_machine, node_app, start_engine, start_logging, with_model
from common.node.startup import StartupError
from common.serving.auth import SignedIdsOnly
from common.serving.context import PrepareHook

if TYPE_CHECKING:
    import torch

    from common.engine.async_engine import AsyncLLMEngine
    from common.engine.kv_connector import KVConnector
    from common.kv_layout import KVLayout
    from common.node.kv_event_publisher import KVEventPublisher
    from common.node.role_flip import RoleFlipper
    from common.kv_transfer.tp_routes import RankRoutes
    from common.kv_transfer.tp_slices import SlicedWorker
    from common.kv_transfer.config import TransferConfig
    from common.kv_transfer.endpoint import KVEndpoint
    from common.proxy_heartbeats import ProxyHeartbeats

logger = logging.getLogger(__name__)

NODE_TYPES = {"prefill": "P", "decode": "D"}


def transfer_config(cfg: NodeConfig) -> TransferConfig:
    """The KV endpoint's knobs from the node's options."""
    from common.kv_transfer.config import TransferConfig

    # the control handshake shares the operation deadline: an unreachable prefill node fails
    # fast; building the data-plane pair after it has its own, longer bound (NCCL's set-up)
    return TransferConfig(timeout_s=cfg.kv_timeout_s, lease_s=cfg.kv_lease_s, handshake_timeout_s=cfg.kv_timeout_s,
                          connect_timeout_s=cfg.kv_connect_timeout_s, max_pairs=cfg.kv_max_pairs,
                          checksum=cfg.kv_checksum)


class TransferConnector(Protocol):
    def bind(self, transfer: KVEndpoint, kv_caches: list[torch.Tensor]) -> None: ...


@contextmanager
def started_daemon(config: NodeConfig, connector: KVConnector) -> Iterator[Daemon]:
    """A daemon with its engine loaded, its KV endpoint bound and its heartbeats running, until
    the block ends; then the engine stops, and after it the heartbeats and the KV endpoint.
    ``connector`` is the role's engine connector; it is also a ``TransferConnector``. Under tensor
    parallelism the worker ranks run ``tp_rank_main``: each serves its own KV endpoint."""
    from common.kv_transfer import tp_rank_main

    start_logging(config)
    check_machine(config)
    config = with_model(config)
    engine = start_engine(config, connector, start=False, rank_main=tp_rank_main.__name__)
    daemon = Daemon(config, engine, NodeMetrics(config.role, config.tensor_parallel_size))
    try:
        daemon.start(connector)  # type: ignore[arg-type]
        engine.start()  # after the KV endpoints: the tensor-parallel group is the engine thread's from here
        yield daemon
    finally:
        engine.shutdown()
        daemon.close()


class Daemon:
    """The parts a daemon adds to a node: KV endpoint, registration, transfer metrics; ``close``
    undoes ``start``."""

    def __init__(self, config: NodeConfig, engine: AsyncLLMEngine, metrics: NodeMetrics) -> None:
        self.config, self.engine, self.metrics = config, engine, metrics
        self.node_id = f"{NODE_TYPES[config.role]}-{socket.gethostname()}-{config.port}-{uuid.uuid4().hex[:6]}"
        self.key = ClusterKey.optional(config.cluster_key_file)
        self.transfer: KVEndpoint | None = None
        self.heartbeater: ProxyHeartbeats | None = None  # one heartbeater per proxy address
        self._exported: dict[str, float] = {}  # transfer counters already turned into metrics
        self._kv_pairs: Gauge | None = None  # pdserve:kv_pairs{role, transport}
        self.rank_stats: list[dict] = []  # tensor parallelism: each rank's transfer counters (rank 0's empty)
        self.routes: RankRoutes | None = None  # decode: loads from a prefill node of another TP size
        self.sliced: SlicedWorker | None = None  # prefill with --kv-ranks: this rank's KV ranks
        self.kv_events: KVEventPublisher | None = None  # its prefix cache's changes, for the proxies' routing
        self.flipper: RoleFlipper | None = None  # its role, epoch and state (common/node/role_flip.py)
        self._caches: list[torch.Tensor] = []  # this rank's KV cache (views), bound to each role's connector

    # ---- start ----------------------------------------------------------------------
    def start(self, connector: TransferConnector) -> None:
        """Bind the KV endpoint, hand it to ``connector``, export its metrics, start heartbeats."""
        from common.kv_transfer.config import TransferStats
        from common.kv_transfer.endpoint import KVEndpoint
        from common.kv_transfer.verify import REASONS
        from common.proxy_heartbeats import ProxyHeartbeats

        cfg, engine, metrics = self.config, self.engine, self.metrics
        if cfg.kv_host_chosen:
            logger.info("bound to %s without --kv-host: peers and the proxy are told %s, this host's "
                        "routable address (set --kv-host to choose another)", cfg.host, cfg.kv_host)
        stats = TransferStats(on_transfer=metrics.observe_transfer)
        # this rank's heads: under tensor parallelism each rank has its own endpoint (tp_ranks); with
        # --kv-ranks, each rank's first slice of them (tp_slices)
        layout, caches, transport = self._first_kv_rank()
        self.transfer = KVEndpoint(
            f"{cfg.host}:{cfg.kv_port}", layout, transfer_config(cfg), stats,
            device=str(engine.engine.device), advertise_host=cfg.kv_host, transport=transport,
            key=self.key, on_progress=engine.wake, vocab_size=engine.engine.model_config.vocab_size,
            role=cfg.role,
        )
        warn_if_open(f"the {cfg.role} daemon (HTTP and KV endpoint)", cfg.host, self.key,
                     "get completions past the proxy's API key, make this node connect to any address, "
                     "and pull or drop other requests' KV")
        self._caches = caches
        self._wire_role(connector)
        self._kv_pairs = Gauge(PREFIX + "kv_pairs", "Live KV data-plane pairs by transport (cuda_ipc, nccl, tcp, "
                               "gloo)", ["role", "transport"], registry=metrics.registry)
        for reason in REASONS:  # a fresh node exports zeros, not nothing
            metrics.kv_transfer_rejected.labels(metrics.role, reason)
        metrics.add_scrape_hook(lambda: self._export_transfer_stats(metrics))
        logger.info("KV endpoint %s (layout %s, fingerprint %s, --kv-transport %s)", cfg.kv_addr,
                    engine.kv_layout, engine.kv_layout.fingerprint(), cfg.kv_transport)
        if cfg.proxy and engine.engine.block_manager.enable_prefix_caching:
            self.kv_events = self._start_kv_events()
        if cfg.kv_peer_fetch == "on":
            self._start_peer_tier()
        if cfg.proxy:
            logger.info("registering with --proxy %s as %s", cfg.proxy, self.node_id)
            self.heartbeater = ProxyHeartbeats(cfg.proxy_entries, self._registration, cfg.heartbeat_interval_s,
                                               cfg.proxy_resolve_interval_s, key=self.key)
            self.heartbeater.start()

    def _wire_role(self, connector: TransferConnector) -> None:
        """The role's connector bound to the KV endpoint and the cache, and the endpoint's half told
        whom it may pair with: at start, and at a role flip (``switch_role``)."""
        assert self.transfer is not None
        connector.bind(self.transfer, self._caches)
        self._start_ranks(connector)
        if self.config.role == "decode":
            self.transfer.consumer.known_peer = self.known_prefill
        else:
            self.transfer.producer.is_member = self.member_decode
        if hasattr(connector, "scheduler") and hasattr(connector.scheduler, "peer_tp_size"):
            connector.scheduler.peer_tp_size = self.prefill_tp_size  # type: ignore[attr-defined]

    def switch_role(self, role: str, connector: KVConnector) -> None:
        """A role flip's swap (common/node/role_flip.py), on the engine thread while it holds no
        request: the KV endpoint's other half, ``connector`` wired to it, the engine given it."""
        assert self.transfer is not None
        if self.routes is not None:  # a decode node's routes to prefill nodes of other TP sizes
            self.routes.close()
            self.routes = None
        self.transfer.switch_role(role)
        self.config = self.config.model_copy(update={"role": role})
        self.metrics.role = role
        self._wire_role(connector)  # type: ignore[arg-type]
        self.engine.engine.set_connector(connector)

    def nudge(self) -> None:
        """Heartbeat every proxy now: the role or its state changed."""
        if self.heartbeater is not None:
            self.heartbeater.nudge()

    def _start_kv_events(self) -> KVEventPublisher:
        """The publisher of the block manager's events (common/node/kv_event_publisher.py), bound
        beside the KV endpoint; the heartbeat advertises it."""
        from common.node.kv_event_publisher import KVEventPublisher, export_metrics

        llm = self.engine.engine
        publisher = KVEventPublisher(self.config.host, self.config.kv_host, llm.block_manager.block_size,
                                     llm.block_manager.cached_hashes, key=self.key,
                                     port=self.config.kv_events_port or 0)
        llm.block_manager.events = publisher.put
        publisher.start()
        export_metrics(publisher, self.metrics.registry, self.metrics.role)
        return publisher

    def _start_peer_tier(self) -> None:
        """The peer tier (issue 35): the engine's KV tiers fetch through this node's KV endpoint, and
        the endpoint serves peers' fetches from the pool and the host tier, on the engine thread
        between steps, then from the file tier on the endpoint's reader thread."""
        assert self.transfer is not None
        engine, transfer = self.engine, self.transfer
        tiers = engine.engine.kv_tiers
        assert tiers is not None  # EngineConfig builds them with --kv-peer-fetch on
        tiers.peer = transfer.peer_fetcher(transfer.config.timeout_s, engine.wake)
        transfer.peers.serve = lambda hashes: engine.call(lambda llm: llm.peer_blocks(hashes))
        if tiers.file is not None:  # then the file tier's run, off the engine thread (none while it is off)
            transfer.peers.serve_rest = tiers.file.read_run
        metrics = self.metrics
        peers = Gauge(PREFIX + "kv_peers", "Peers this node may fetch prefix blocks from (the peer tier: those "
                      "the registry named)", ["role"], registry=metrics.registry)
        served = Gauge(PREFIX + "kv_peer_served_blocks", "Prefix blocks this node served to peers' fetches",
                       ["role"], registry=metrics.registry)

        def export() -> None:
            peers.labels(metrics.role).set(len(self.heartbeater.peers) if self.heartbeater is not None else 0)
            served.labels(metrics.role).set(transfer.peers.served_blocks)
        metrics.add_scrape_hook(export)
        logger.info("peer tier on: fetching prefix blocks from the peers the registry names, serving ours at %s",
                    self.config.kv_addr)

    def peer_vouched(self, kv_addr: str) -> bool:
        """May this node fetch prefix blocks from ``kv_addr`` (a proxy's hint)? With --kv-peer-fetch on,
        when a registry named it among this node's peers (same model and KV layout, peer fetch on)."""
        peers = self.heartbeater.peers if self.heartbeater is not None else frozenset()
        return self.config.kv_peer_fetch == "on" and kv_addr in peers and kv_addr != self.config.kv_addr

    @property
    def slices(self) -> int:
        """KV ranks per rank: more than one on a prefill node with --kv-ranks above its TP size."""
        return self.config.kv_rank_count // self.config.tensor_parallel_size

    def _first_kv_rank(self) -> tuple[KVLayout, list[torch.Tensor], str]:
        """The layout, cache (views) and transport of this rank's first KV endpoint: the rank's
        heads, or their first slice (``tp_slices``; refused in one line when they do not cut)."""
        from common.kv_transfer.tp_endpoints import view_transport
        from common.kv_transfer.tp_slices import slice_caches, slice_heads, slice_layout

        llm, cfg, k = self.engine.engine, self.config, self.slices
        layout, caches = llm.runner.kv_layout, llm.kv_caches
        if k == 1:
            return layout, caches, cfg.kv_transport
        if layout.num_kv_heads % k:
            raise StartupError(f"--kv-ranks {cfg.kv_rank_count}: each of the {cfg.tensor_parallel_size} rank(s) "
                               f"holds {layout.num_kv_heads} KV head(s), which do not cut into {k} equal slices")
        return (slice_layout(layout, k), slice_caches(caches, slice_heads(layout.num_kv_heads, k, 0)),
                view_transport(str(llm.device), cfg.kv_transport))

    def _start_ranks(self, connector: TransferConnector) -> None:
        """Tensor parallelism: every worker rank opens its KV endpoint at kv-port + rank, and rank 0's
        connector worker tells them each decision and combines their reports (``tp_ranks``). A decode
        node also gets routes for loads from a prefill node of a larger TP size (``tp_routes``).
        Runs before the engine thread starts: the group's collectives are that thread's afterwards."""
        from common.kv_transfer.tp_endpoints import endpoint_spec, engine_opener, kv_rank_workers, start_rank_endpoints
        from common.kv_transfer.tp_ranks import LeaderKVWorker
        from common.kv_transfer.tp_routes import RankRoutes, RoutedWorker

        cfg, llm = self.config, self.engine.engine
        leader, k = llm.runner.leader, self.slices
        if leader is None and cfg.role != "decode" and k == 1:
            return
        assert self.transfer is not None
        port = int(self.transfer.address.rpartition(":")[2])
        spec = endpoint_spec(cfg.role, cfg.host, port, cfg.kv_host, cfg.kv_transport, cfg.cluster_key_file,
                             self.transfer.config, llm.model_config.vocab_size, k)
        opener = engine_opener(json.loads(spec), str(llm.device), self.transfer.stats, f"{cfg.kv_host}:{port}")
        if leader is not None:
            start_rank_endpoints(leader, spec)
        if cfg.kv_rank_count > 1:
            logger.info("KV ranks 1..%d at %s:%d..%d (%d per tensor-parallel rank)", cfg.kv_rank_count - 1,
                        cfg.host, port + 1, port + cfg.kv_rank_count - 1, k)
        worker = connector.worker  # type: ignore[attr-defined]  # the engine's, or at a flip the new role's
        if k > 1:  # this rank's other KV ranks (tp_slices)
            worker = self.sliced = kv_rank_workers(worker, k, port, llm.runner.kv_layout, llm.kv_caches, opener)
        if cfg.role == "decode":
            self.routes = RankRoutes(0, cfg.tensor_parallel_size, llm.kv_layout.num_kv_heads, llm.runner.kv_layout,
                                     llm.kv_caches, opener)
        scheduler = connector.scheduler  # type: ignore[attr-defined]
        if leader is not None:
            # a prefill node's worker ranks give their pair slots to members first by rank 0's list
            members = self.decode_members if cfg.role == "prefill" else lambda: None
            worker = LeaderKVWorker(worker, leader, cfg.role, self.routes, self.prefill_tp_size, members)
            self.rank_stats = worker.rank_stats
            if cfg.role == "decode":
                scheduler.still_landing = worker.outcomes.landing
        elif self.routes is not None:
            worker, routes = RoutedWorker(worker, self.routes, self.prefill_tp_size), self.routes
            scheduler.still_landing = lambda request_id: request_id in routes.loads
        llm.kv_worker = connector.worker = worker  # type: ignore[attr-defined]

    def _export_rank_stats(self, metrics: NodeMetrics, own: dict) -> None:
        """Each rank's bytes and transfer seconds (``rank`` label; rank 0's own counters, the
        workers' from their last poll report). The workers' bytes count in kv_transfer_bytes too:
        that one is the node's."""
        direction = "bytes_sent" if self.config.role == "prefill" else "bytes_received"
        ranks = [own] + self.rank_stats[1:]
        for rank, stats in enumerate(ranks):
            for name, counter in ((direction, metrics.kv_rank_transfer_bytes),
                                  ("transfer_seconds_sum", metrics.kv_rank_transfer_seconds)):
                key, value = f"rank{rank}:{name}", stats.get(name, 0)
                delta = value - self._exported.get(key, 0)
                if delta > 0:
                    counter.labels(metrics.role, str(rank)).inc(delta)
                    if rank > 0 and name == direction:
                        metrics.kv_transfer_bytes.labels(metrics.role).inc(delta)
                self._exported[key] = value

    def build_app(self, prepare_request: PrepareHook | None = None) -> FastAPI:
        """The node's OpenAI app, ready once the KV endpoint is up and the proxy has heard from us."""
        app = node_app(self.engine, self.config, self.metrics, ready=self.ready, prepare_request=prepare_request)
        app.state.serving.peer_vouched = self.peer_vouched
        return app

    def require_signed_ids(self, app: FastAPI) -> None:
        """With a cluster key, only ids the proxy signed reach the routes. Call it after every other
        middleware: added last, it runs first, so nothing runs for an unsigned id."""
        if self.key is not None:
            # the role read at each request: it changes at a flip (common/node/role_flip.py)
            app.add_middleware(SignedIdsOnly, key=self.key, role=lambda: self.config.role,
                               kv_addr=self.config.kv_addr, max_bytes=self.config.max_request_bytes,
                               unsigned_kv_params=self.config.accept_unsigned_kv_transfer_params)

    def known_prefill(self, kv_addr: str) -> bool:
        """May this node pull KV from ``kv_addr``? With a cluster key the id naming it was signed by
        the proxy; else it must be in --kv-peers or in the registries' member lists (their union,
        ``ProxyHeartbeats.members``); with neither
        (keyless behind vLLM's proxy or none), any address, as vLLM does (trusted networks only)."""
        if self.key is not None or self.vouched_prefill(kv_addr):
            return True
        members = self.heartbeater.members if self.heartbeater is not None else None
        return members is None and not self.config.kv_peer_list

    def member_decode(self, kv_addr: str) -> bool:
        """Does a pair's consumer at ``kv_addr`` count as a member (its pair's slot is never given to
        a stranger's)? With a cluster key, yes: its handshake was sealed. Keyless, when the registry
        names it among the decode nodes it answers this prefill node with; with no answer (no
        proxy, or vLLM's), every consumer counts, as before. Rank 0's endpoint asks this; the other
        KV endpoints ask ``decode_members``' list, which rank 0 forwards (``tp_ranks``), by the same rule."""
        members = self.decode_members()
        return members is None or kv_addr in members

    def decode_members(self) -> frozenset[str] | None:
        """The consumers' KV addresses that count as members (one per decode KV rank), or None when
        every consumer does: with a cluster key, or before the registry answered (or without one)."""
        if self.key is not None or self.heartbeater is None:
            return None
        return self.heartbeater.members

    def prefill_tp_size(self, kv_addr: str) -> int:
        """The TP size the registry last gave for the prefill node at ``kv_addr`` (0: not said; a
        one-rank node is not listed, so a listed registry's silence means 1)."""
        if self.heartbeater is None or self.heartbeater.members is None:
            return 0
        return self.heartbeater.member_tp_sizes.get(kv_addr, 1)

    def vouched_prefill(self, kv_addr: str) -> bool:
        """Is ``kv_addr`` named by --kv-peers or by the registry's last member list (not merely
        allowed because this node was told nothing)?"""
        members = self.heartbeater.members if self.heartbeater is not None else None
        return kv_addr in self.config.kv_peer_list or (members is not None and kv_addr in members)

    def ready(self) -> bool:
        serving = self.flipper is None or self.flipper.role_state == "serving"
        return serving and self.transfer is not None and (self.heartbeater is None or self.heartbeater.beats_sent > 0)

    def _registration(self) -> dict:
        from common.registry_client import adaptive_figures, transfer_figures

        engine = self.engine
        s = engine.stats()
        role, epoch, state = self.flipper.beat if self.flipper else (self.config.role, None, None)
        return {
            "type": NODE_TYPES[role],
            "http_address": f"{self.config.kv_host}:{self.config.port}",
            "zmq_address": self.config.kv_addr,
            "model": engine.model_name,
            "kv_fingerprint": engine.kv_layout.fingerprint(),
            "tp_size": self.config.tensor_parallel_size,
            "kv_heads": engine.kv_layout.num_kv_heads,
            "block_size": engine.kv_layout.block_size,
            **({"kv_ranks": self.config.kv_rank_count} if self.slices > 1 else {}),
            "node_id": self.node_id,
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_free_blocks": s.num_free_blocks,
            "num_total_blocks": s.num_total_blocks,
            "engine_stalled_s": round(engine.stalled_for(), 3),
            **adaptive_figures(s),
            **transfer_figures(engine.kv_layout, self.transfer.stats.recv_bytes_per_s if self.transfer else None),
            **(self.kv_events.heartbeat(engine.engine.scheduler.cache_root) if self.kv_events else {}),
            **({"role_epoch": epoch, "role_state": state} if self.flipper else {}),
            **({"kv_peer_fetch": True} if self.config.kv_peer_fetch == "on" else {}),
        }

    def _export_transfer_stats(self, metrics: NodeMetrics) -> None:
        """Counters the KV endpoint keeps, turned into Prometheus increments at scrape.
        (Received bytes and transfer times arrive through ``TransferStats.on_transfer``.)"""
        assert self.transfer is not None
        snap = self.transfer.stats.snapshot()
        counters = {"failures": metrics.kv_transfer_failures, "leases_expired": metrics.kv_leases_expired,
                    "bytes_sent": metrics.kv_transfer_bytes}
        for name, counter in counters.items():
            delta = snap[name] - self._exported.get(name, 0)
            if delta > 0:
                counter.labels(metrics.role).inc(delta)
            self._exported[name] = snap[name]
        for reason, count in self.transfer.stats.rejected_counts().items():  # verify.py's reasons
            key = "rejected:" + reason
            if count > self._exported.get(key, 0):
                metrics.kv_transfer_rejected.labels(metrics.role, reason).inc(count - self._exported.get(key, 0))
            self._exported[key] = count
        self._export_rank_stats(metrics, snap)
        counts = self.transfer.pair_counts()
        assert self._kv_pairs is not None
        for transport in ("cuda_ipc", "nccl", "tcp", "gloo"):
            self._kv_pairs.labels(metrics.role, transport).set(counts.get(transport, 0))

    # ---- stop -----------------------------------------------------------------------
    def close(self) -> None:
        if self.heartbeater is not None:
            self.heartbeater.stop()
        if self.kv_events is not None:
            self.kv_events.stop()
        if self.routes is not None:
            self.routes.close()
        if self.sliced is not None:
            self.sliced.close()
        if self.transfer is not None:
            self.transfer.close()
        logger.info("KV endpoint closed")
