"""One KV transfer endpoint per daemon process: control plane, pairs, producer, consumer.

The prefill daemon uses ``engine.producer``, the decode daemon ``engine.consumer``; a
process may use both. Every call the engine thread makes returns without waiting on the
network; results are polled (``producer.poll_freeable``, ``consumer.poll_finished``), and
``on_progress`` (the engine thread's wake-up) is called, from a transfer thread, whenever a
poll would return something new: a waiting engine steps at once instead of at its next poll.
"""

from __future__ import annotations

from collections.abc import Callable

from common.cluster_auth import ClusterKey
from common.kv_layout import KVLayout
from common.kv_transfer.config import TransferConfig, TransferStats
from common.kv_transfer.consumer import KVConsumer
from common.kv_transfer.control import ControlPlane, split_address
from common.kv_transfer.messages import Message
from common.kv_transfer.producer import KVProducer
from common.kv_transfer.transport import check_mode


class KVTransferEngine:
    """Binds a ROUTER at ``zmq_address`` ("host:port", port 0 = any free port).

    ``device`` is where this process's KV cache lives; with ``transport`` (``--kv-transport``:
    auto, cuda_ipc, nccl, tcp or gloo) it decides each pair's data plane at its handshake
    (transport.py). ``advertise_host`` is the address peers use to reach this process
    (default: the bind host); ``key`` (the cluster key) seals every control message;
    ``vocab_size`` bounds the token ids a producer's DONE may carry.
    """

    def __init__(self, zmq_address: str, layout: KVLayout, config: TransferConfig | None = None,
                 stats: TransferStats | None = None, device: str = "cpu", advertise_host: str | None = None,
                 transport: str = "auto", key: ClusterKey | None = None,
                 on_progress: Callable[[], None] | None = None, vocab_size: int | None = None) -> None:
        check_mode(transport)
        self.layout = layout
        self.config = config or TransferConfig()
        self.stats = stats or TransferStats()
        host, _ = split_address(zmq_address)
        # peers reach the pair's store here: the bind host may be 0.0.0.0, which they cannot dial
        self.producer = KVProducer(layout, self.config, self.stats, advertise_host or host, device, transport)
        self.consumer = KVConsumer(layout, self.config, self.stats, transport, vocab_size)
        self.control = ControlPlane(zmq_address, self._on_router, self._on_dealer, key=key,
                                    idle_s=self.config.peer_idle_s, max_peers=self.config.max_peers)
        self.producer.control = self.consumer.control = self.control
        if on_progress is not None:
            self.producer.on_progress = self.consumer.on_progress = on_progress
        self.address = self.control.address
        self.consumer.address = f"{advertise_host or host}:{split_address(self.address)[1]}"

    def _on_router(self, identity: bytes, msg: Message) -> None:
        self.producer.handle(identity, msg)

    def _on_dealer(self, address: str, msg: Message) -> None:
        self.consumer.handle(address, msg)

    def pair_counts(self) -> dict[str, int]:
        """Live data-plane pairs by transport, both halves together (for /metrics)."""
        counts: dict[str, int] = {}
        for transport in self.producer.pair_transports() + self.consumer.pair_transports():
            counts[transport] = counts.get(transport, 0) + 1
        return counts

    def close(self) -> None:
        """Stop every thread, close every pair and socket."""
        self.consumer.close()
        self.producer.close()
        self.control.close()

    def __enter__(self) -> KVTransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
