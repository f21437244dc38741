"""Producer side (prefill node): hold a request's KV under a lease, push it when asked.

A request's life here, by its one record in the :class:`~common.kv_transfer.producer_table.ProducerTable`
(``table``; its docstring has the transitions): the consumer may PULL before or after
prefill (PULLED or HELD). ``save_layer`` (engine thread, after each layer) queues a layer
only if the consumer already asked (gloo/nccl: staged, if the byte budget allows; tcp and
cuda_ipc: sent from the blocks); otherwise the KV simply stays in the paged blocks. Each
queued job carries an event recorded on the engine's stream after its KV was written (or
gathered): the sender orders its work after it (streams.py).
``finish`` starts the lease; once both the pull and the finish are in, every layer not
yet queued is queued for the pair's sender thread, then DONE with the first token
(SENDING, then AWAITING_ACK). The consumer's ACK, an ABORT, a failed pair or an expired
lease make the request freeable (RELEASED, taken by ``poll_freeable``).

Pairs: at most ``max_pairs`` (``--kv-max-pairs``). Keyless, a pair whose consumer names no
registered decode node (``is_member``) is a stranger's: it keeps its slot ``probation_s`` at
most and is the first dropped when a member's handshake finds every slot taken (``_take_slot``).
A consumer refused a pair computes the prompt itself (decode_node/connector.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.kv_layout import KVLayout
from common.kv_transfer.config import TransferConfig, TransferStats
from common.kv_transfer.cuda_ipc import open_cache
from common.kv_transfer.messages import (UNKNOWN_PAIR, Abort, Ack, Error, Handshake, HandshakeOk, Message, Ok,
                                         Ping, Pull)
from common.kv_transfer.paged import ByteBudget, block_run, gather_blocks
from common.kv_transfer.producer_table import ProducerRequest, ProducerState, ProducerTable
from common.kv_transfer.sender import PairSender, SendJob
from common.kv_transfer.streams import StreamOps, stream_ops
from common.kv_transfer.verify import use_checksum
from common.kv_transfer.transport import (Endpoint, TransportMismatchError, choose_transport, ipc_fallback,
                                          listen)

if TYPE_CHECKING:
    from common.kv_transfer.control import ControlPlane

logger = logging.getLogger(__name__)


class KVProducer:
    """The producer half of :class:`~common.kv_transfer.endpoint.KVEndpoint`."""

    def __init__(self, layout: KVLayout, config: TransferConfig, stats: TransferStats, host: str,
                 device: str = "cpu", transport: str = "auto", streams: StreamOps | None = None) -> None:
        self.layout, self.config, self.stats, self._host = layout, config, stats, host
        self.device = device  # where the KV cache lives: with ``transport``, picks each pair's data plane
        self.transport = transport
        self.streams = streams or stream_ops(device)  # orders the GPU paths' work (streams.py)
        self.control: ControlPlane | None = None  # set by the engine once bound
        # keyless: does this KV address name a registered decode node (the daemon sets it from the
        # registry's answer; with a key, or with no registry answer, every consumer is a member)
        self.is_member: Callable[[str], bool] = lambda consumer: True
        self.table = ProducerTable()  # the one record per transfer (the connector reads it too)
        self._lock = self.table.lock  # one lock: a record's move and the sends it queues go together
        self._links: dict[str, PairSender] = {}
        self._budget = ByteBudget(config.max_bytes_in_flight)
        self._closed = False
        # called when ``poll_freeable`` would return something new (may run under our lock:
        # it must neither block nor call back into the producer)
        self.on_progress: Callable[[], None] = lambda: None

    # ---- admission (HTTP thread) --------------------------------------------------------
    def reserve_unclaimed(self, request_id: str, num_blocks: int, limit_blocks: int) -> bool:
        """Admit a prefill whose KV nobody asked for yet, if what is held (or about to be) for
        unclaimed requests stays within ``limit_blocks``; forged ids cannot pin the cache."""
        with self._lock:
            return self.table.reserve(request_id, num_blocks, limit_blocks, time.monotonic(), self.config.lease_s)

    # ---- engine thread ---------------------------------------------------------------
    def save_layer(self, request_id: str, layer_idx: int, kv_layer: torch.Tensor, block_ids: list[int]) -> None:
        """After layer ``layer_idx`` of the pass that completes the prompt: queue it if the
        consumer already asked and the staging budget has room. Never blocks on the network."""
        with self._lock:
            req = self.table.records.get(request_id)
            if req is None or req.link is None or req.dropped or layer_idx in req.queued_layers:
                return
            ids = block_ids[req.first_block: req.first_block + req.num_blocks]
            if len(ids) < req.num_blocks:
                return  # sent from the paged blocks after finish()
            if req.link.transport in ("tcp", "cuda_ipc"):  # sent from the blocks: nothing staged
                self.table.queue(req, [layer_idx])
                req.link.put(SendJob("layers", req, [layer_idx], source=(kv_layer, ids),
                                          ready=self._kv_written(kv_layer)))
                return
            if not self._budget.try_acquire(len(ids) * self.layout.bytes_per_block_per_layer()):
                return
            self.table.queue(req, [layer_idx])
            # Queued under the lock: a pair failing now either sees this job when it drains
            # its queue or marks the request dropped before we get here (no leaked budget).
            staged = gather_blocks(kv_layer, ids)
            # the gather runs on the engine's stream; the send waits for it on another
            req.link.put(SendJob("layers", req, [layer_idx], staged.unsqueeze(0),
                                      ready=self._kv_written(kv_layer)))

    def finish(self, request_id: str, first_token: int, kv_caches: list[torch.Tensor],
               block_ids: list[int], num_tokens: int, first_logprobs: dict[int, float] | None = None,
               choices: list | None = None, cached_tokens: int = 0) -> None:
        """The prompt is done: start the lease; send whatever the consumer still needs (the
        first token travels with its logprobs when the request asked for them, and with the
        other choices' first tokens when it asked for n > 1: ``Done.choices``)."""
        with self._lock:
            req = self.table.finish(  # HELD
                request_id, time.monotonic() + self.config.lease_s, first_token=first_token,
                first_logprobs=[[t, lp] for t, lp in (first_logprobs or {}).items()], choices=list(choices or []),
                cached_tokens=cached_tokens, kv_caches=kv_caches, block_ids=block_ids,
                ready=self._kv_written(kv_caches[0]) if kv_caches else None)
            if req is None:
                self.on_progress()  # aborted or expired while prefill ran: only its blocks are freed
                return
            self._queue_rest(req)  # SENDING if pulled

    def _kv_written(self, kv_layer: torch.Tensor):
        """An event after the work queued so far on the engine's stream (None on CPU)."""
        return self.streams.record(self.streams.current(kv_layer.device))

    def discard(self, request_id: str, why: str) -> None:
        """The engine dropped the request before ``finish`` (aborted, failed): forget it, and
        tell a consumer that already asked. The caller frees the blocks itself."""
        with self._lock:
            req = self.table.drop(request_id, why)
            if req is not None and req.link is not None and self.control is not None:
                self.control.reply(req.link.identity, Error(reason=why, request_id=request_id))

    def discard_all(self, why: str) -> int:
        """:meth:`discard` every request this side still holds (a role flip's drain ran out); how many."""
        with self._lock:
            held = list(self.table.records)
        for request_id in held:
            self.discard(request_id, why)
        return len(held)

    def request_state(self, request_id: str) -> str:
        """A :class:`~common.kv_transfer.producer_table.ProducerState` value while the request is live,
        "gone" (dropped) or "unknown" (never seen, or acknowledged)."""
        with self._lock:
            req = self.table.records.get(request_id)
            if req is None or req.state is ProducerState.RELEASED and not req.dropped:
                return "unknown"
            return "gone" if req.dropped else req.state.value

    def queued_layers(self, request_id: str) -> int:
        """How many of the request's layers are queued for sending (0 when unknown)."""
        with self._lock:
            req = self.table.records.get(request_id)
            return len(req.queued_layers) if req is not None else 0

    def poll_freeable(self) -> set[str]:
        """Requests whose blocks may be freed now. Also enforces leases: call every step."""
        self._expire_leases()
        with self._lock:
            return self.table.poll_freeable()

    # ---- I/O thread -------------------------------------------------------------------
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
        with self._lock:  # the consumer is still there: its pair stays (a silent one is closed)
            for link in self._links.values():
                if link.pair_id == msg.pair_id or (not msg.pair_id and link.identity == identity):
                    link.heard()
                if msg.pair_id and link.pair_id == msg.pair_id:
                    # Replies for the pair go where its pings come from: a consumer whose control
                    # connection was opened anew since the handshake has a new ZMQ identity, and
                    # an error sent to the old one is dropped (its transfer would wait out its deadline).
                    link.identity = identity
                    # DONE left this side's socket, not yet the wire: on a slow link the bytes queued
                    # before it can take longer than the lease to arrive. The consumer that pings is
                    # alive and bounds its own wait (no layer landing for timeout_s fails the request
                    # and ABORTs here), so its pair's ACK leases run on from now.
                    self.table.renew_acks(link, time.monotonic() + self.config.lease_s)
        self._reply(identity, Ok(id=msg.id))

    def _on_handshake(self, identity: bytes, msg: Handshake) -> None:
        try:
            theirs = KVLayout.from_dict(msg.layout)
        except (KeyError, TypeError) as e:
            self._reply(identity, Error(id=msg.id, reason=f"bad layout in handshake: {e}"))
            return
        diff = self.layout.diff(theirs)
        if diff:
            reason = "KV layout mismatch (producer vs consumer): " + "; ".join(diff)
            self._reply(identity, Error(id=msg.id, reason=reason))
            return
        with self._lock:
            admitted, member, dropped = self._take_slot(msg.consumer)
        for link in dropped:
            self.link_failed(link, "its slot went to a registered decode node's pair")  # fails what it carried
            link.drop()  # after: link_failed drains the pair's queue, the stop included
            logger.info("producer: dropped pair %s of %r: it names no registered decode node and its slot "
                        "was needed or its %g s are up", link.pair_id[:8], link.consumer, self.config.probation_s)
        if not admitted:  # each pair is a thread and sockets: keyless, anyone reaching the port could ask
            reason = f"{self.config.max_pairs} KV pairs already open (--kv-max-pairs); try again later"
            logger.warning("producer: refused a pair: %s", reason)
            self._reply(identity, Error(id=msg.id, reason=reason))
            return
        try:
            mine, theirs = Endpoint.local(self.device), Endpoint.from_dict(msg.endpoint)
            transport = choose_transport(self.transport, mine, msg.backend, theirs)
            if transport == "cuda_ipc" and not msg.ipc:
                raise TransportMismatchError("cuda_ipc chosen but the consumer exported no KV cache")
        except (TransportMismatchError, ValueError, KeyError, TypeError) as e:
            logger.warning("producer: refused a pair: %s", e)
            self._reply(identity, Error(id=msg.id, reason=str(e)))
            return
        peer_cache = None
        if transport == "cuda_ipc":
            try:
                peer_cache = open_cache(msg.ipc)  # here, not on the sender thread: failing refuses the pair
            except RuntimeError as e:
                transport = ipc_fallback(self.transport, mine, msg.backend, theirs) or ""
                if not transport:
                    reason = (f"cannot map the decode daemon's KV cache over CUDA IPC ({e}): run both "
                              "daemons with the same CUDA_VISIBLE_DEVICES (two containers: share the host's "
                              "IPC and PID namespaces), or use --kv-transport nccl on two GPUs")
                    logger.warning("producer: refused a pair: %s", reason)
                    self._reply(identity, Error(id=msg.id, reason=reason))
                    return
                logger.info("producer: cannot map the consumer's cache (%s); pair uses nccl", e)
        rendezvous = listen(transport, self._host, self.config.connect_timeout_s)
        assert self.control is not None
        link = PairSender(msg.pair_id, identity, config=self.config, stats=self.stats, budget=self._budget,
                          control=self.control, device=self.device, on_done_sent=self.done_sent,
                          on_failed=self.link_failed, on_message=self.handle, streams=self.streams,
                          in_use=self.link_in_use, table=self.table)
        link.checksum = use_checksum(msg.checksum, self.config.checksum, transport)
        if not link.checksum and "on" in (msg.checksum, self.config.checksum) and transport == "cuda_ipc":
            logger.warning("producer: --kv-checksum on, but pair %s is cuda_ipc (a GPU-to-GPU copy, nothing "
                           "to hash): it checks nonce, layers and bytes only", msg.pair_id[:8])
        link.consumer = msg.consumer
        link.probation_until = None if member else time.monotonic() + self.config.probation_s
        with self._lock:
            if self._closed:
                if hasattr(rendezvous, "close"):
                    rendezvous.close()
                return
            self._links[msg.pair_id] = link
        link.start(rendezvous, transport, peer_cache)
        logger.info("producer: pair %s uses %s", msg.pair_id[:8], transport)
        port = rendezvous.port if rendezvous is not None else 0
        self._reply(identity, HandshakeOk(id=msg.id, pair_id=msg.pair_id, store_host=self._host,
                                          store_port=port, backend=transport, checksum=link.checksum))

    def _take_slot(self, consumer: str) -> tuple[bool, bool, list[PairSender]]:
        """(a slot for a new pair of ``consumer``, whether it is a member, the pairs dropped for it).

        Members' slots are never taken by strangers: a pair whose consumer names no registered
        decode node (keyless; ``is_member``) holds its slot only for ``probation_s`` (promoted if
        its decode node registered meanwhile) and is the first to go when a member needs one.
        Lock held."""
        now, dropped = time.monotonic(), []
        for link in [x for x in self._links.values() if x.probation_until is not None and x.probation_until <= now]:
            if self.is_member(link.consumer):
                link.probation_until = None
            else:
                dropped.append(self._links.pop(link.pair_id))
        member = self.is_member(consumer)
        if member and len(self._links) >= self.config.max_pairs:
            busy = {r.link.pair_id for r in self.table.records.values() if r.link is not None and not r.dropped}
            strangers = sorted((x for x in self._links.values() if x.probation_until is not None),
                               key=lambda x: (x.pair_id in busy, x.probation_until))
            if strangers:
                dropped.append(self._links.pop(strangers[0].pair_id))
        return len(self._links) < self.config.max_pairs, member, dropped

    def _on_pull(self, identity: bytes, msg: Pull) -> None:
        with self._lock:
            link = self._links.get(msg.pair_id)
            if link is not None:
                link.heard()
                link.last_used = time.monotonic()
            req = self.table.records.get(msg.request_id)
            why = req.why if req is not None else None
            if why is None and (link is None or link.broken):
                why = UNKNOWN_PAIR
            elif why is None and req is not None and (req.link is not None or req.state is ProducerState.RELEASED):
                why = "request already pulled"
            elif why is None and not 0 <= msg.first_block < msg.num_blocks:
                why = f"first block {msg.first_block} is outside the prompt's {msg.num_blocks} blocks"
            if why is not None:
                self._reply(identity, Error(id=msg.id, reason=why, request_id=msg.request_id))
                return
            # a new PULLED record if the consumer asked before prefill finished (a reservation is claimed)
            req = self.table.pulled(msg.request_id, time.monotonic() + self.config.lease_s, link, msg.block_ids,
                                    msg.num_blocks, msg.first_block, msg.nonce)
            if msg.id:  # 0: came in-band on a tcp pair, where nobody waits for an answer
                self._reply(identity, Ok(id=msg.id))
            self._queue_rest(req)

    def _on_ack(self, identity: bytes, msg: Ack) -> None:
        with self._lock:
            req = self.table.ack(msg.request_id)
            if req is not None:
                self.on_progress()  # an Event's set: takes no lock of ours
                self.stats.transfer_sent(time.monotonic() - req.created)

    def _on_abort(self, identity: bytes, msg: Abort) -> None:
        with self._lock:
            req = self.table.records.get(msg.request_id)
            self._drop(msg.request_id, "aborted by the consumer")
            if not msg.id:
                return  # fire-and-forget (the consumer never gave us blocks to write into)
            links = [req.link] if req is not None and req.link is not None else \
                [link for link in self._links.values() if link.identity == identity]
            ipc = [link for link in links if link.transport == "cuda_ipc"]
            if ipc:  # answered by the sender once its stream drained: no copy lands after the reply
                fence_req = req or ProducerRequest(msg.request_id)  # in no table: the fence only answers
                ipc[0].put(SendJob("fence", fence_req, reply_id=msg.id))
                return
        self._reply(identity, Ok(id=msg.id))

    # ---- shared helpers (lock held) ----------------------------------------------------
    def _queue_rest(self, req: ProducerRequest) -> None:
        if req.state is not ProducerState.HELD or req.link is None:
            return
        if len(req.block_ids) < req.num_blocks:
            self._fail_request(req, f"producer has {len(req.block_ids)} blocks, consumer wants {req.num_blocks}")
            return
        rest = [layer for layer in range(self.layout.num_layers) if layer not in req.queued_layers]
        self.table.queue(req, rest)
        ids = req.block_ids[: req.num_blocks]
        # gloo/nccl send a contiguous run in place layer by layer and gather anything else;
        # tcp never gathers. Small layers are coalesced: every message has a fixed cost.
        gathers = req.link.transport in ("gloo", "nccl")
        per_msg = 1 if gathers and block_run(ids) else max(1, self.config.coalesce_bytes // max(
            1, len(ids) * self.layout.bytes_per_block_per_layer()))
        if req.link.transport in ("tcp", "cuda_ipc"):  # copied in place, nothing staged: one job, one notice
            per_msg = max(1, len(rest))
        for i in range(0, len(rest), per_msg):
            req.link.put(SendJob("layers", req, rest[i:i + per_msg]))
        req.link.put(SendJob("done", req))
        self.table.sending(req)

    def _fail_request(self, req: ProducerRequest, reason: str) -> None:
        if req.link is not None and self.control is not None:
            self.control.reply(req.link.identity, Error(reason=reason, request_id=req.request_id))
        self.stats.add(failures=1)
        self._drop(req.request_id, reason)

    def _drop(self, request_id: str, why: str) -> None:
        req = self.table.drop(request_id, why)
        if req is not None and req.state is ProducerState.RELEASED:
            self.on_progress()  # its blocks may be freed: an Event's set, takes no lock of ours

    def _expire_leases(self) -> None:
        now = time.monotonic()
        with self._lock:
            for req in [r for r in self.table.records.values() if r.deadline is not None and r.deadline <= now
                        and r.state is not ProducerState.RESERVED]:
                self.stats.add(leases_expired=1)
                reason = "producer lease expired"
                # not a normal release: a decode node asked for nothing, or never acknowledged
                logger.warning("request %s: KV lease (%g s) expired %s; its blocks are freed", req.request_id,
                               self.config.lease_s, "before any decode node asked" if req.link is None
                               else "before the decode node acknowledged")
                if req.link is not None and self.control is not None:
                    self.control.reply(req.link.identity, Error(reason=reason, request_id=req.request_id))
                self._drop(req.request_id, reason)

    # ---- what a pair's sender reports (I/O thread) ------------------------------------------
    def done_sent(self, req: ProducerRequest) -> None:
        """DONE is out: the lease runs again until the consumer's ACK."""
        with self._lock:
            self.table.done_sent(req, time.monotonic() + self.config.lease_s)

    def link_failed(self, link: PairSender, reason: str) -> None:
        """The pair broke (or closed idle): every request on it fails, its queued jobs go."""
        with self._lock:
            self._links.pop(link.pair_id, None)
            for req in [r for r in self.table.records.values() if r.link is link and not r.dropped
                        and r.state is not ProducerState.RELEASED]:
                self._fail_request(req, f"transfer failed: {reason}")
            link.drain()  # under the lock: nothing can be queued to this pair any more

    def link_in_use(self, link: PairSender) -> bool:
        """Whether a live request still uses the pair (an idle one may be closed)."""
        with self._lock:
            return any(r.link is link and not r.dropped and r.state is not ProducerState.RELEASED
                       for r in self.table.records.values())

    # ---- metrics and shutdown ------------------------------------------------------------
    def pair_transports(self) -> list[str]:
        with self._lock:
            return [link.transport for link in self._links.values() if not link.broken]

    def links(self) -> list[PairSender]:
        with self._lock:
            return list(self._links.values())

    def close(self) -> None:
        """Close every pair, on the I/O thread (before the endpoint closes it)."""
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        for link in links:  # a pair whose consumer never joined stops waiting for it now
            link.drop()
        assert self.control is not None
        self.control.run_and_wait(lambda: [link.close() for link in links], self.config.timeout_s)
        for link in links:
            if link.builder is not None:
                link.builder.join(timeout=self.config.timeout_s)
