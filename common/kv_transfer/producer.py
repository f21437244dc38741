"""Producer side (prefill node): hold a request's KV under a lease, push it when asked.

A request's life here: the consumer may PULL before or after prefill. ``save_layer``
(engine thread, after each layer) stages and queues a layer only if the consumer already
asked and the byte budget allows; otherwise the KV simply stays in the paged blocks.
``finish`` starts the lease; once both the pull and the finish are in, every layer not
yet queued is queued (gathered later by the pair's sender thread), then DONE with the
first token. The consumer's ACK, an ABORT, a failed pair or an expired lease make the
request freeable (``poll_freeable``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.kv_layout import KVLayout
from common.kv_transfer.config import TransferConfig, TransferStats
from common.kv_transfer.messages import Abort, Ack, Error, Handshake, HandshakeOk, Message, Ok, Ping, Pull
from common.kv_transfer.p2p_group import backend_for, host_store
from common.kv_transfer.paged import ByteBudget, block_run, gather_blocks
from common.kv_transfer.sender import PairSender, SendJob

if TYPE_CHECKING:
    from common.kv_transfer.control import ControlPlane

logger = logging.getLogger(__name__)


@dataclass
class ProducerRequest:
    request_id: str
    deadline: float | None  # lease; None while layers are being sent
    link: PairSender | None = None
    num_blocks: int = 0
    finished: bool = False
    first_token: int = 0
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    queued_layers: set[int] = field(default_factory=set)
    dropped: bool = False
    done_queued: bool = False


class KVProducer:
    """The producer half of :class:`~common.kv_transfer.engine.KVTransferEngine`."""

    def __init__(self, layout: KVLayout, config: TransferConfig, stats: TransferStats, host: str,
                 device: str = "cpu") -> None:
        self.layout, self.config, self.stats, self._host = layout, config, stats, host
        self.device = device  # where the KV cache lives: picks gloo or NCCL for the pairs
        self.control: ControlPlane | None = None  # set by the engine once bound
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._links: dict[str, PairSender] = {}
        self._freeable: set[str] = set()
        self._gone: collections.OrderedDict[str, str] = collections.OrderedDict()  # id -> why
        self._budget = ByteBudget(config.max_bytes_in_flight)
        self._closed = False

    # ---- engine thread ---------------------------------------------------------------
    def save_layer(self, request_id: str, layer_idx: int, kv_layer: torch.Tensor, block_ids: list[int]) -> None:
        """After layer ``layer_idx`` of the pass that completes the prompt: queue it if the
        consumer already asked and the staging budget has room. Never blocks on the network."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is None or req.link is None or req.dropped or layer_idx in req.queued_layers:
                return
            ids = block_ids[: req.num_blocks]
            nbytes = len(ids) * self.layout.bytes_per_block_per_layer()
            if len(ids) < req.num_blocks or not self._budget.try_acquire(nbytes):
                return  # sent from the paged blocks after finish()
            req.queued_layers.add(layer_idx)
            # Queued under the lock: a pair failing now either sees this job when it drains
            # its queue or marks the request dropped before we get here (no leaked budget).
            staged = gather_blocks(kv_layer, ids)
            req.link.jobs.put(SendJob("layers", req, [layer_idx], staged.unsqueeze(0)))

    def finish(self, request_id: str, first_token: int, kv_caches: list[torch.Tensor],
               block_ids: list[int], num_tokens: int) -> None:
        """The prompt is done: start the lease; send whatever the consumer still needs."""
        with self._lock:
            if request_id in self._gone:
                self._freeable.add(request_id)  # aborted or expired while prefill ran
                return
            req = self._requests.setdefault(request_id, ProducerRequest(request_id, None))
            req.finished, req.first_token = True, first_token
            req.kv_caches, req.block_ids = kv_caches, list(block_ids)
            req.deadline = time.monotonic() + self.config.lease_s
            self._queue_rest(req)

    def discard(self, request_id: str, why: str) -> None:
        """The engine dropped the request before ``finish`` (aborted, failed): forget it, and
        tell a consumer that already asked. The caller frees the blocks itself."""
        with self._lock:
            req = self._requests.get(request_id)
            if req is not None and req.link is not None and self.control is not None:
                self.control.reply(req.link.identity, Error(reason=why, request_id=request_id))
            self._drop(request_id, why)

    def poll_freeable(self) -> set[str]:
        """Requests whose blocks may be freed now. Also enforces leases: call every step."""
        self._expire_leases()
        with self._lock:
            out, self._freeable = self._freeable, set()
        return out

    # ---- control thread --------------------------------------------------------------
    def handle(self, identity: bytes, msg: Message) -> None:
        handler = {Handshake: self._on_handshake, Pull: self._on_pull, Ack: self._on_ack,
                   Abort: self._on_abort, Ping: self._on_ping}.get(type(msg))
        if handler is None:
            logger.warning("producer: dropped unexpected %s", msg.CMD)
            return
        handler(identity, msg)

    def _reply(self, identity: bytes, msg: Message) -> None:
        assert self.control is not None
        self.control.reply(identity, msg)

    def _on_ping(self, identity: bytes, msg: Ping) -> None:
        self._reply(identity, Ok(id=msg.id))

    def _on_handshake(self, identity: bytes, msg: Handshake) -> None:
        try:
            theirs = KVLayout.from_dict(msg.layout)
        except (KeyError, TypeError) as e:
            self._reply(identity, Error(id=msg.id, reason=f"bad layout in handshake: {e}"))
            return
        diff = self.layout.diff(theirs)
        if msg.backend != backend_for(self.device):
            diff.append(f"backend: {backend_for(self.device)} != {msg.backend}")
        if diff:
            reason = "KV layout mismatch (producer vs consumer): " + "; ".join(diff)
            self._reply(identity, Error(id=msg.id, reason=reason))
            return
        store = host_store(self._host, self.config.handshake_timeout_s)
        assert self.control is not None
        link = PairSender(msg.pair_id, identity, config=self.config, stats=self.stats, budget=self._budget,
                          control=self.control, device=self.device, on_done_sent=self._on_done_sent,
                          on_failed=self._link_failed)
        with self._lock:
            if self._closed:
                return
            self._links[msg.pair_id] = link
        link.start(store, msg.backend)
        self._reply(identity, HandshakeOk(id=msg.id, pair_id=msg.pair_id, store_host=self._host, store_port=store.port))

    def _on_pull(self, identity: bytes, msg: Pull) -> None:
        with self._lock:
            link = self._links.get(msg.pair_id)
            why = self._gone.get(msg.request_id)
            req = self._requests.get(msg.request_id)
            if why is None and (link is None or link.broken):
                why = "unknown or broken pair; handshake again"
            elif why is None and req is not None and req.link is not None:
                why = "request already pulled"
            if why is not None:
                self._reply(identity, Error(id=msg.id, reason=why, request_id=msg.request_id))
                return
            if req is None:  # the consumer asked before we saw the request
                req = ProducerRequest(msg.request_id, time.monotonic() + self.config.lease_s)
                self._requests[msg.request_id] = req
            req.link, req.num_blocks = link, msg.num_blocks
            self._reply(identity, Ok(id=msg.id))
            self._queue_rest(req)

    def _on_ack(self, identity: bytes, msg: Ack) -> None:
        with self._lock:
            if self._requests.pop(msg.request_id, None) is not None:
                self._freeable.add(msg.request_id)
                self.stats.add(transfers_sent=1)

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        with self._lock:
            self._drop(msg.request_id, "aborted by the consumer")

    # ---- shared helpers (lock held) ----------------------------------------------------
    def _queue_rest(self, req: ProducerRequest) -> None:
        if not (req.finished and req.link is not None) or req.done_queued:
            return
        if len(req.block_ids) < req.num_blocks:
            self._fail_request(req, f"producer has {len(req.block_ids)} blocks, consumer wants {req.num_blocks}")
            return
        rest = [layer for layer in range(self.layout.num_layers) if layer not in req.queued_layers]
        req.queued_layers.update(rest)
        ids = req.block_ids[: req.num_blocks]
        # A contiguous run is sent in place layer by layer; anything else is gathered, and
        # small layers are coalesced because every data-plane message has a fixed cost.
        per_msg = 1 if block_run(ids) else max(1, self.config.coalesce_bytes // max(
            1, len(ids) * self.layout.bytes_per_block_per_layer()))
        for i in range(0, len(rest), per_msg):
            req.link.jobs.put(SendJob("layers", req, rest[i:i + per_msg]))
        req.link.jobs.put(SendJob("done", req))
        req.done_queued, req.deadline = True, None

    def _fail_request(self, req: ProducerRequest, reason: str) -> None:
        if req.link is not None and self.control is not None:
            self.control.reply(req.link.identity, Error(reason=reason, request_id=req.request_id))
        self.stats.add(failures=1)
        self._drop(req.request_id, reason)

    def _drop(self, request_id: str, why: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            req.dropped = True
            if req.finished:
                self._freeable.add(request_id)
        self._gone[request_id] = why
        while len(self._gone) > 10_000:
            self._gone.popitem(last=False)

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            for req in [r for r in self._requests.values() if r.deadline is not None and r.deadline <= now]:
                self.stats.add(leases_expired=1)
                reason = "producer lease expired"
                if req.link is not None and self.control is not None:
                    self.control.reply(req.link.identity, Error(reason=reason, request_id=req.request_id))
                self._drop(req.request_id, reason)

    def _on_done_sent(self, req: ProducerRequest) -> None:
        with self._lock:
            req.deadline = time.monotonic() + self.config.lease_s  # now waiting for the ACK

    def _link_failed(self, link: PairSender, reason: str) -> None:
        with self._lock:
            self._links.pop(link.pair_id, None)
            for req in [r for r in self._requests.values() if r.link is link]:
                self._fail_request(req, f"transfer failed: {reason}")
            link.drain()  # under the lock: nothing can be queued to this pair any more

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.stop(self.config.timeout_s + 1)
