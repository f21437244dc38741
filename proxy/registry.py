"""The service registry: which prefill and decode nodes exist, fed by ZMQ heartbeats.

A listener thread owns a ROUTER socket. Each message is a registration (vLLM's three
keys or our richer heartbeat, see common.registry_client); it adds or refreshes the
node keyed by (type, http_address), and ``goodbye`` removes it. The same thread sweeps
every ``sweep_interval_s``: a node silent for ``heartbeat_timeout_s`` (or three of its
own heartbeat intervals, if longer) is evicted even when no other node is sending.
Static nodes from config are never evicted.

Anyone who can reach the port can send anything, so every message passes, in order:
libzmq's size cap (an oversized message closes its connection before it is buffered),
the sender's rate limit, the cluster key's seal (when a key is set), the one validating
model, keyless the sender's own address (:func:`from_own_address`: a node may register, or say
goodbye for, only the host its connection comes from), and ``max_nodes``. A rejected message
is dropped, counted by reason (:meth:`rejected`), and logged at most once per sender per
minute. Nothing a message holds can end the thread.

Nodes are indexed by (model, KV fingerprint), the unit the router pairs within; the
router reads :meth:`groups`, a snapshot rebuilt only when membership changes.

The answer to a heartbeat names the nodes it pairs with (``members``) and, to a node running
``--kv-peer-fetch on``, its ``peers``: the other nodes of its model and layout that run it too,
whose cached prefix blocks it may fetch (issue 35). A node that joins is named to those at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq

from common.cluster_auth import ClusterKey, registry_sealer
from common.registry_client import (MAX_MESSAGE_BYTES, RegistrationError, RegistrationMessage, decode,
                                    encode_members, zmq_endpoint)
from proxy.source_address import from_own_address, peer_address

logger = logging.getLogger(__name__)
GroupKey = tuple[str | None, str | None]  # (model, kv_fingerprint)


@dataclass
class Node:
    """A registered node as the router sees it (refreshed in place by each heartbeat)."""

    info: RegistrationMessage
    last_seen: float
    static: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.info.type, self.info.http_address)

    @property
    def group(self) -> GroupKey:
        return (self.info.model, self.info.kv_fingerprint)


@dataclass(frozen=True)
class Group:
    """Nodes that can pair with each other: same model and KV layout, sorted by address."""

    model: str | None
    kv_fingerprint: str | None
    prefills: tuple[Node, ...]
    decodes: tuple[Node, ...]


@dataclass
class _Sender:
    tokens: float
    stamp: float
    last_log: float = field(default=-1e18)


class ServiceRegistry:
    """Thread-safe node table; ``start()`` begins listening, ``stop()`` ends it."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 30001,
        heartbeat_timeout_s: float = 6.0,
        sweep_interval_s: float = 1.0,
        static_nodes: list[RegistrationMessage] | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        key: ClusterKey | None = None,
        max_nodes: int = 1024,
        rate_per_s: float = 20.0,
    ):
        self.host = host
        self.port = port  # 0 until start() binds a free port
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.sweep_interval_s = sweep_interval_s
        self.max_nodes = max_nodes
        self.rate_per_s = rate_per_s  # per sender; a daemon beats every ~2 s
        self._sealer = registry_sealer(key)
        self._keyless = key is None
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[tuple[str, str], Node] = {}
        self._groups: tuple[Group, ...] | None = None  # snapshot; None = rebuild on next read
        self._peer_fetchers: tuple[tuple[Group, ...], tuple[Node, ...]] = ((), ())  # of which groups snapshot
        self._senders: OrderedDict[bytes, _Sender] = OrderedDict()
        # each node's connection and its latest message, by type: told at once when a node of the
        # other type joins (a decode node pulls only from the prefill nodes it was told of, and a
        # keyless prefill node keeps pair slots for the decode nodes it was told of)
        self._member_senders: dict[str, OrderedDict[bytes, RegistrationMessage]] = {
            "P": OrderedDict(), "D": OrderedDict()}
        self._rejected: Counter[str] = Counter()  # reason -> messages dropped
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        for msg in static_nodes or []:
            self.register(msg, static=True)

    # -- node table -------------------------------------------------------------

    def register(self, msg: RegistrationMessage, static: bool = False) -> str | None:
        """Add, refresh or (``goodbye``) remove a node; None when done, else why it was refused.
        A heartbeat from a static node keeps it static."""
        now = self._clock()
        key = (msg.type, msg.http_address)
        with self._lock:
            old = self._nodes.get(key)
            if msg.goodbye:
                if old is not None and not old.static:
                    del self._nodes[key]
                    self._groups = None
                    logger.info("node said goodbye: %s %s", msg.type, msg.http_address)
                return None
            if old is None:
                other = self._nodes.get(("D" if msg.type == "P" else "P", msg.http_address))
                if other is not None and not other.static:
                    # the same node in its other role: a role flip (common/node/role_flip.py) moves it at
                    # once; a beat from before the flip (a lower epoch) is refused
                    if (msg.role_epoch or 0) <= (other.info.role_epoch or 0):
                        return "stale_role_epoch"
                    del self._nodes[other.key]
                    logger.info("node changed role: %s -> %s %s (role epoch %d)", other.info.type, msg.type,
                                msg.http_address, msg.role_epoch or 0)
                if len(self._nodes) >= self.max_nodes:
                    return "full"
                self._nodes[key] = Node(msg, now, static)
                self._groups = None
                logger.info("node registered: %s %s kv=%s model=%s", msg.type, msg.http_address,
                            msg.zmq_address, msg.model)
                return None
            # a node that turned --kv-peer-fetch on or off (restarted within its timeout) changes
            # :meth:`peer_fetchers`, which shares the groups' snapshot
            regrouped = ((msg.model, msg.kv_fingerprint) != old.group or msg.routable != old.info.routable
                         or msg.kv_peer_fetch != old.info.kv_peer_fetch)
            if msg.routable != old.info.routable:
                logger.info("node %s %s is %s (role epoch %d)", msg.type, msg.http_address,
                            msg.role_state or "serving", msg.role_epoch or 0)
            old.info, old.last_seen, old.static = msg, now, static or old.static
            if regrouped:
                self._groups = None
        return None

    def timeout_for(self, node: Node) -> float:
        """Silence allowed: the configured timeout, or three of the node's own intervals if longer
        (a node beating slower than the proxy expects must not flap in and out)."""
        return max(self.heartbeat_timeout_s, 3.0 * (node.info.heartbeat_interval_s or 0.0))

    def sweep(self) -> list[Node]:
        """Evict nodes silent longer than their timeout; returns the evicted."""
        now = self._clock()
        with self._lock:
            dead = [n for n in self._nodes.values() if not n.static and now - n.last_seen > self.timeout_for(n)]
            for node in dead:
                del self._nodes[node.key]
            if dead:
                self._groups = None
        for node in dead:
            logger.warning("node evicted after %.1f s without heartbeat: %s %s",
                           self.timeout_for(node), node.info.type, node.info.http_address)
        return dead

    def nodes(self, node_type: str | None = None) -> list[Node]:
        """A snapshot of the nodes, optionally only 'P' or 'D'."""
        with self._lock:
            return [n for n in self._nodes.values() if node_type is None or n.info.type == node_type]

    def get(self, node_type: str, http_address: str) -> Node | None:
        """The node of that type at that address, if registered."""
        with self._lock:
            return self._nodes.get((node_type, http_address))

    def stalled_for(self, node: Node) -> float:
        """How long ``node``'s engine has been stuck in one iteration, as of now: what its last
        heartbeat said plus that heartbeat's age (0 for a node that does not report it)."""
        reported = node.info.engine_stalled_s
        return reported + max(0.0, self._clock() - node.last_seen) if reported else 0.0

    def groups(self) -> tuple[Group, ...]:
        """Routable nodes by (model, fingerprint); the same snapshot until membership or a node's
        routability (``RegistrationMessage.routable``) changes."""
        with self._lock:
            if self._groups is None:
                by_key: dict[GroupKey, tuple[list[Node], list[Node]]] = {}
                # a node draining for a role flip, or fenced after one failed, takes no new request
                routable = (n for n in self._nodes.values() if n.info.routable)
                for n in sorted(routable, key=lambda n: n.info.http_address):
                    by_key.setdefault(n.group, ([], []))[0 if n.info.type == "P" else 1].append(n)
                self._groups = tuple(Group(m, fp, tuple(p), tuple(d)) for (m, fp), (p, d) in by_key.items())
            return self._groups

    def peer_fetchers(self) -> list[RegistrationMessage]:
        """The routable nodes running ``--kv-peer-fetch on`` (issue 35's peer tier), as of their last
        heartbeat; which nodes they are is worked out again only when :meth:`groups` changes."""
        groups = self.groups()
        cached = self._peer_fetchers
        if cached[0] is not groups:
            fetchers = tuple(n for g in groups for n in (*g.prefills, *g.decodes) if n.info.kv_peer_fetch)
            cached = self._peer_fetchers = (groups, fetchers)
        return [n.info for n in cached[1]]

    def rejected(self) -> dict[str, int]:
        """Messages dropped so far, by reason (a metric label)."""
        with self._lock:
            return dict(self._rejected)

    def _reject(self, reason: str) -> None:
        with self._lock:
            self._rejected[reason] += 1

    def counts(self) -> dict[str, int]:
        out = {"P": 0, "D": 0}
        for group in self.groups():
            out["P"] += len(group.prefills)
            out["D"] += len(group.decodes)
        return out

    # -- listener thread ----------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def listening(self) -> bool:
        """The listener thread runs (readiness: a registry that cannot hear nodes is not ready)."""
        return self._thread is not None and self._thread.is_alive()

    def start(self) -> None:
        """Bind the ROUTER and start the listener; raises zmq.ZMQError if the port is taken."""
        if self._thread is not None:
            return
        self._stop.clear()
        self._bound.clear()
        self._bind_error = None
        self._thread = threading.Thread(target=self._run, name="pdserve-registry", daemon=True)
        self._thread.start()
        self._bound.wait(10)
        if self._bind_error is not None:
            self._thread.join()
            self._thread = None
            raise self._bind_error

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def _bind(self, ctx: zmq.Context) -> zmq.Socket:
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        # libzmq drops the connection of a peer sending more: a 50 MB frame is never buffered
        sock.setsockopt(zmq.MAXMSGSIZE, 2 * MAX_MESSAGE_BYTES)
        sock.setsockopt(zmq.RCVHWM, 10_000)
        try:
            if self.port == 0:
                self.port = sock.bind_to_random_port(zmq_endpoint(self.host))
            else:
                sock.bind(zmq_endpoint(self.address))
        except zmq.ZMQError:
            sock.close()  # else ctx.term() waits for it forever
            raise
        return sock

    def _run(self) -> None:
        ctx = zmq.Context()
        try:
            sock = self._bind(ctx)
        except zmq.ZMQError as exc:
            self._bind_error = exc
            self._bound.set()
            ctx.term()
            return
        self._bound.set()
        logger.info("registry listening on %s", self.address)
        poll_ms = max(1, int(min(self.sweep_interval_s, 0.2) * 1000))  # bounds stop() latency too
        next_sweep = self._clock() + self.sweep_interval_s
        try:
            while not self._stop.is_set():
                try:
                    if sock.poll(poll_ms, zmq.POLLIN):
                        self._receive(sock)
                    if self._clock() >= next_sweep:
                        self.sweep()
                        next_sweep = self._clock() + self.sweep_interval_s
                except Exception:  # noqa: BLE001 - the registry outlives any bug a message finds
                    self._reject("internal")
                    logger.exception("registry: unexpected error; still listening")
        finally:
            sock.close(linger=0)
            ctx.term()

    def _receive(self, sock: zmq.Socket) -> None:
        for _ in range(1000):  # then sweep: a flood must not starve eviction
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            sender, body = frames[0].bytes, [f.bytes for f in frames[1:]]
            peer = peer_address(frames[1]) if len(frames) > 1 else None
            reason = self._admit(sender)
            if reason is None:
                payload, reason = self._sealer.open(body) if body else (None, "frame_count")
                if payload is not None:
                    try:
                        msg = decode(payload)
                        if self._keyless and not from_own_address(msg, peer):
                            self._reject("address_not_source")
                            self._log(sender, f"registration refused: without a cluster key a node registers only "
                                      f"its own address, and {msg.http_address} / {msg.zmq_address} is not "
                                      f"{peer}, where the message came from")
                            continue
                        joining = not msg.goodbye and self.get(msg.type, msg.http_address) is None
                        reason = self.register(msg)
                        if reason is None:
                            self._remember(sender, msg)
                            if not msg.goodbye:
                                self._send_members(sock, sender, msg)
                        if reason is None and joining:
                            # tell the other type's nodes now, not at their next heartbeat (~2 s in
                            # which the proxy would route them requests naming a node they refuse),
                            # and a peer fetcher's peers of either type that it is one of theirs
                            others = self._member_senders["D" if msg.type == "P" else "P"]
                            told = list(others.items())
                            if msg.kv_peer_fetch:
                                told += [(peer, peer_msg) for peer, peer_msg in self._member_senders[msg.type].items()
                                         if peer_msg.kv_peer_fetch and peer != sender]
                            for other, other_msg in told:
                                self._send_members(sock, other, other_msg)
                    except RegistrationError as exc:
                        reason = "invalid"
                        self._log(sender, f"ignored a bad registration message: {exc}")
            if reason is not None:
                self._reject(reason)
                self._log(sender, f"registration rejected ({reason})")

    def _remember(self, sender: bytes, msg: RegistrationMessage) -> None:
        for table in self._member_senders.values():  # a node that changed role is told only its new role's peers
            table.pop(sender, None)
        senders = self._member_senders[msg.type]
        if not msg.goodbye:
            senders[sender] = msg
            while len(senders) > self.max_nodes:
                senders.popitem(last=False)

    def _send_members(self, sock: zmq.Socket, sender: bytes, msg: RegistrationMessage) -> None:
        """Answer a heartbeat with the KV addresses of the other type's nodes of its model and
        layout. A decode node pulls from no prefill node but these (issue 22); a keyless prefill
        node keeps its pair slots for these decode nodes, one address per KV rank (issue 33).
        vLLM's nodes ignore the answer."""
        same = [n.info for n in self.nodes("D" if msg.type == "P" else "P")
                if (n.info.model, n.info.kv_fingerprint) == (msg.model, msg.kv_fingerprint)]
        if msg.type == "P":
            members = sorted({a for d in same for a in _rank_addresses(d.zmq_address, d.tp_size or 1)})
            tp_sizes: dict[str, int] = {}
        else:
            members = sorted({p.zmq_address for p in same})
            # what a decode node routes by: each prefill node's KV ranks (one per rank, unless --kv-ranks)
            tp_sizes = {p.zmq_address: p.kv_ranks or p.tp_size for p in same if (p.kv_ranks or p.tp_size or 1) > 1}
        answer = encode_members(members, tp_sizes, self._peers_of(msg))
        try:
            sock.send_multipart([sender, *self._sealer.frames(answer)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the node went, or is not reading: its next heartbeat gets the next answer

    def _peers_of(self, msg: RegistrationMessage) -> list[str]:
        """To a node running ``--kv-peer-fetch on``: the KV addresses of every other registered node,
        either type, of its model and layout that runs it too, with one rank (a peer fetch moves a
        whole block from one endpoint); none to any other node."""
        if not msg.kv_peer_fetch:
            return []
        return sorted({n.info.zmq_address for n in self.nodes()
                       if n.info.kv_peer_fetch and (n.info.tp_size or 1) == 1 and n.info.zmq_address != msg.zmq_address
                       and (n.info.model, n.info.kv_fingerprint) == (msg.model, msg.kv_fingerprint)})

    def _admit(self, sender: bytes) -> str | None:
        """Token bucket per sender (its ZMQ connection); the table keeps the 4,096 latest senders."""
        now = self._clock()
        state = self._senders.get(sender)
        if state is None:
            state = self._senders[sender] = _Sender(tokens=2 * self.rate_per_s, stamp=now)
            while len(self._senders) > 4096:
                self._senders.popitem(last=False)
        self._senders.move_to_end(sender)
        state.tokens = min(2 * self.rate_per_s, state.tokens + (now - state.stamp) * self.rate_per_s)
        state.stamp = now
        if state.tokens < 1:
            return "rate_limited"
        state.tokens -= 1
        return None

    def _log(self, sender: bytes, message: str) -> None:
        state = self._senders.get(sender)
        now = self._clock()
        if state is not None and now - state.last_log >= 60.0:
            state.last_log = now
            logger.warning("%s (sender %s; more from it are not logged for a minute)", message, sender.hex())



def _rank_addresses(zmq_address: str, num_ranks: int) -> list[str]:
    """A decode node's KV endpoints: rank r handshakes from its ``zmq_address``'s port + r."""
    host, _, port = zmq_address.rpartition(":")
    return [f"{host}:{int(port) + r}" for r in range(num_ranks)]
