"""The service registry: which prefill and decode nodes exist, fed by ZMQ heartbeats.

A listener thread owns a ROUTER socket. Each frame is a registration message
(vLLM's three keys or our richer heartbeat, see common.registry_client); it adds or
refreshes the node keyed by (type, http_address). The same thread sweeps every
``sweep_interval_s``: a node silent for ``heartbeat_timeout_s`` (or three of its own
heartbeat intervals, if longer) is evicted even when no other node is sending. Static nodes from config are never evicted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import zmq

from common.registry_client import RegistrationError, RegistrationMessage, decode, zmq_endpoint

logger = logging.getLogger(__name__)


@dataclass
class Node:
    """A registered node as the router sees it."""

    info: RegistrationMessage
    last_seen: float
    static: bool = False

    @property
    def key(self) -> tuple[str, str]:
        return (self.info.type, self.info.http_address)


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
    ):
        self.host = host
        self.port = port  # 0 until start() binds a free port
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.sweep_interval_s = sweep_interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[tuple[str, str], Node] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bound = threading.Event()
        self._bind_error: BaseException | None = None
        for msg in static_nodes or []:
            self.register(msg, static=True)

    # -- node table -------------------------------------------------------------

    def register(self, msg: RegistrationMessage, static: bool = False) -> None:
        """Add or refresh a node; a heartbeat from a static node keeps it static."""
        now = self._clock()
        key = (msg.type, msg.http_address)
        with self._lock:
            old = self._nodes.get(key)
            if old is None:
                logger.info("node registered: %s %s kv=%s model=%s", msg.type, msg.http_address,
                            msg.zmq_address, msg.model)
            self._nodes[key] = Node(msg, now, static or (old is not None and old.static))

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
        for node in dead:
            logger.warning("node evicted after %.1f s without heartbeat: %s %s",
                           self.timeout_for(node), node.info.type, node.info.http_address)
        return dead

    def nodes(self, node_type: str | None = None) -> list[Node]:
        """A snapshot of the nodes, optionally only 'P' or 'D'."""
        with self._lock:
            return [n for n in self._nodes.values() if node_type is None or n.info.type == node_type]

    def counts(self) -> dict[str, int]:
        out = {"P": 0, "D": 0}
        for node in self.nodes():
            out[node.info.type] += 1
        return out

    # -- listener thread ----------------------------------------------------------

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

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
                if sock.poll(poll_ms, zmq.POLLIN):
                    self._receive(sock)
                if self._clock() >= next_sweep:
                    self.sweep()
                    next_sweep = self._clock() + self.sweep_interval_s
        finally:
            sock.close(linger=0)
            ctx.term()

    def _receive(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.register(decode(frames[-1]))
            except RegistrationError as exc:
                logger.warning("ignored a bad registration message: %s", exc)
