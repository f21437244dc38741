"""On a cuda_ipc pair the producer writes into the consumer's blocks from its own process:
a transfer that fails because its link broke must not hand its blocks back for reuse
before the producer said it writes no more into them (or its answer's deadline passed).

Runs on CPU against a fake producer that accepts a cuda_ipc pair (nothing travels on it:
the consumer's side of such a pair holds nothing) and leaves the PULL unanswered, which
breaks the link.
"""

from __future__ import annotations

import queue

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.control import ControlPlane
from common.kv_transfer.endpoint import KVEndpoint
from common.kv_transfer.messages import Abort, Handshake, HandshakeOk, Message, Ok, Ping
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from test_kvt_engine import d_cache, wait_finished

CFG = TransferConfig(**dict(FAST, timeout_s=0.5))


class SilentIpcProducer:
    """Accepts a cuda_ipc pair, answers pings, never answers a PULL; ABORTs are queued for
    the test to answer (or not)."""

    def __init__(self) -> None:
        self.aborts: queue.Queue[tuple[bytes, Abort]] = queue.Queue()
        self.control = ControlPlane("127.0.0.1:0", self._on_message, lambda address, msg: None)
        self.address = self.control.address

    def _on_message(self, identity: bytes, msg: Message) -> None:
        if isinstance(msg, Handshake):
            self.control.reply(identity, HandshakeOk(id=msg.id, pair_id=msg.pair_id, store_host="127.0.0.1",
                                                     backend="cuda_ipc"))
        elif isinstance(msg, Ping):
            self.control.reply(identity, Ok(id=msg.id))
        elif isinstance(msg, Abort):
            self.aborts.put((identity, msg))

    def close(self) -> None:
        self.control.close()


def test_broken_ipc_link_frees_blocks_only_once_the_producer_confirms(no_thread_leak):
    producer = SilentIpcProducer()
    try:
        with KVEndpoint("127.0.0.1:0", LAYOUT, CFG) as d:
            d.consumer.request("f", producer.address, [1, 2], 8, d_cache())
            identity, abort = producer.aborts.get(timeout=10)  # the PULL went unanswered: the link broke
            assert abort.request_id == "f" and abort.id  # a request: the consumer waits for the answer
            assert d.consumer.poll_finished() == ({}, {})  # not failed yet: its blocks stay out of reuse
            assert d.consumer.transfer_state("f") not in ("failed", "unknown")
            producer.control.reply(identity, Ok(id=abort.id))  # "my streams drained"
            done, failed = wait_finished(d, {"f"})
            assert done == {} and "did not answer PULL" in failed["f"]
            assert d.pair_counts() == {}  # the broken pair was dropped at once
    finally:
        producer.close()


def test_unanswered_fence_frees_blocks_at_its_deadline(no_thread_leak):
    """A producer that answers nothing is taken for dead once the ABORT's deadline passed:
    the request fails (no hang), as an unanswered abort does."""
    producer = SilentIpcProducer()
    try:
        with KVEndpoint("127.0.0.1:0", LAYOUT, CFG) as d:
            d.consumer.request("g", producer.address, [3], 4, d_cache())
            assert producer.aborts.get(timeout=10)[1].request_id == "g"
            done, failed = wait_finished(d, {"g"})
            assert done == {} and "did not answer PULL" in failed["g"]
    finally:
        producer.close()
