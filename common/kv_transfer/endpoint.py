"""One KV transfer endpoint per daemon process: control plane, pairs, producer, consumer.

The prefill daemon's endpoint (``role="prefill"``) builds only ``engine.producer``, the decode
daemon's (``role="decode"``) only ``engine.consumer``; ``role="both"`` (tests, benchmarks)
builds the two. Every call the engine thread makes returns without waiting on the
network; results are polled (``producer.poll_freeable``, ``consumer.poll_finished``), and
``on_progress`` (the engine thread's wake-up) is called, from a transfer thread, whenever a
poll would return something new: a waiting engine steps at once instead of at its next poll.
Both halves run on the control plane's thread, the endpoint's I/O thread: one thread for
every pair; what must be waited on (a pair's build, gloo/NCCL work, CUDA copies) waits on
a short-lived or per-pair thread and comes back to it as a call (waiter.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from common.cluster_auth import ClusterKey
from common.kv_layout import KVLayout
from common.kv_transfer.config import TransferConfig, TransferStats
from common.kv_transfer.consumer import KVConsumer
from common.kv_transfer.control import ControlPlane, split_address
from common.kv_transfer.messages import Abort, Error, FetchBlocks, Message
from common.kv_transfer.peer_fetch import PeerFetcher, PeerServer
from common.kv_transfer.producer import KVProducer
from common.kv_transfer.transport import check_mode

ROLES = ("prefill", "decode", "both")


class KVEndpoint:
    """Binds a ROUTER at ``zmq_address`` ("host:port", port 0 = any free port).

    ``device`` is where this process's KV cache lives; with ``transport`` (``--kv-transport``:
    auto, cuda_ipc, nccl, tcp or gloo) it decides each pair's data plane at its handshake
    (transport.py). ``advertise_host`` is the address peers use to reach this process
    (default: the bind host); ``key`` (the cluster key) seals every control message;
    ``vocab_size`` bounds the token ids a producer's DONE may carry; ``role`` picks the halves
    built (prefill: the producer, decode: the consumer, both).
    """

    def __init__(self, zmq_address: str, layout: KVLayout, config: TransferConfig | None = None,
                 stats: TransferStats | None = None, device: str = "cpu", advertise_host: str | None = None,
                 transport: str = "auto", key: ClusterKey | None = None,
                 on_progress: Callable[[], None] | None = None, vocab_size: int | None = None,
                 role: str = "both") -> None:
        check_mode(transport)
        if role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.layout, self.role = layout, role
        self.config = config or TransferConfig()
        self.stats = stats or TransferStats()
        host, _ = split_address(zmq_address)
        # peers reach the pair's store here: the bind host may be 0.0.0.0, which they cannot dial
        self._host, self._device, self._transport = advertise_host or host, device, transport
        self._vocab_size = vocab_size
        self._on_progress = on_progress
        self._switching = False  # switch_role under way (or failed half-way)
        self._producer = self._new_half("prefill") if role != "decode" else None
        self._consumer = self._new_half("decode") if role != "prefill" else None
        self.control = ControlPlane(zmq_address, self._on_router, self._on_dealer, key=key,
                                    idle_s=self.config.peer_idle_s, max_peers=self.config.max_peers)
        self.address = self.control.address
        # the peer tier (peer_fetch.py), either role: serves once ``peers.serve`` is set
        self.peers = PeerServer(self.control, layout.fingerprint(),
                                layout.bytes_per_block_per_layer() * layout.num_layers)
        for half in self._halves():
            self._attach(half)
        self.control.on_tick = self._tick  # the pairs' pings, deadlines and idleness

    def _new_half(self, role: str):
        """A role's half: the producer (prefill) or the consumer (decode), not attached yet."""
        if role == "prefill":
            return KVProducer(self.layout, self.config, self.stats, self._host, self._device, self._transport)
        return KVConsumer(self.layout, self.config, self.stats, self._transport, self._vocab_size)

    def _attach(self, half: KVProducer | KVConsumer) -> None:
        half.control = self.control
        if self._on_progress is not None:
            half.on_progress = self._on_progress
        if isinstance(half, KVConsumer):
            half.address = f"{self._host}:{split_address(self.address)[1]}"

    def switch_role(self, role: str) -> None:
        """A daemon's role flip (common/node/role_flip.py): close this endpoint's half (its pairs)
        and build the other role's on the same control plane, so the KV address and the cluster
        key stay. Not from the I/O thread; the halves are swapped on it, between two messages."""
        if self.role == "both" or role not in ("prefill", "decode"):
            raise ValueError(f"a {self.role} endpoint cannot switch to {role!r}")
        if role == self.role and not self._switching:
            return
        self._switching = True  # until the new half is in: a switch that failed half-way is redone in full
        for half in self._halves():
            half.close()
        new = self._new_half(role)
        self._attach(new)

        def swap() -> None:
            self._producer, self._consumer = (new, None) if role == "prefill" else (None, new)

        if not self.control.run_and_wait(swap, self.config.timeout_s):
            raise TimeoutError(f"the KV endpoint's I/O thread did not take the {role} half within "
                               f"{self.config.timeout_s} s")
        self.role, self._switching = role, False

    @property
    def producer(self) -> KVProducer:
        if self._producer is None:
            raise AttributeError(f"a {self.role} node's KV endpoint has no producer half")
        return self._producer

    @property
    def consumer(self) -> KVConsumer:
        if self._consumer is None:
            raise AttributeError(f"a {self.role} node's KV endpoint has no consumer half")
        return self._consumer

    def _halves(self) -> list:
        return [h for h in (self._producer, self._consumer) if h is not None]

    def _tick(self) -> None:
        """Every pair's pings, deadlines and idleness, on the I/O thread (``control.on_tick``)."""
        now = time.monotonic()
        for half in self._halves():
            for link in half.links():
                link.tick(now)

    def peer_fetcher(self, timeout_s: float, on_news: Callable[[], None]) -> PeerFetcher:
        """A fetcher of prefix blocks from peers (the peer tier), asking over this endpoint."""
        layout = self.layout
        return PeerFetcher(self.control, layout.fingerprint(), layout.block_shape(), layout.torch_dtype, timeout_s,
                           on_news)

    def _on_router(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, FetchBlocks):
            self.peers.handle(identity, msg)
        elif self._producer is not None:
            self._producer.handle(identity, msg)
        elif msg.id:  # asked a decode node for KV: told at once, not left to its deadline
            self.control.reply(identity, Error(id=msg.id, reason="this KV endpoint is a decode node's: "
                                                                "it has no KV to give"))

    def _on_dealer(self, address: str, msg: Message) -> None:
        if self._consumer is not None:
            self._consumer.handle(address, msg)

    def release_remote(self, request_id: str, prefill_addr: str, connect: bool) -> None:
        """Tell the producer at ``prefill_addr`` to drop ``request_id``'s KV, whatever this endpoint's
        half: a node that refuses a decode leg it no longer serves (a role flip, common/node/role_flip.py)
        frees the prefill node's KV now, not at its lease's end. ``connect``: as for the consumer's."""
        self.control.send(prefill_addr, Abort(request_id=request_id), connect=connect)

    def pair_counts(self) -> dict[str, int]:
        """Live data-plane pairs by transport, both halves together (for /metrics)."""
        counts: dict[str, int] = {}
        for half in self._halves():
            for transport in half.pair_transports():
                counts[transport] = counts.get(transport, 0) + 1
        return counts

    def close(self) -> None:
        """Stop every thread, close every pair and socket."""
        for half in reversed(self._halves()):
            half.close()
        self.peers.close()
        self.control.close()

    def __enter__(self) -> KVEndpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
