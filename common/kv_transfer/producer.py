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
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.kv_layout import KVLayout
from common.kv_transfer.config import PairBrokenError, TransferConfig, TransferStats
from common.kv_transfer.messages import Abort, Ack, Done, Error, Handshake, HandshakeOk, LayerNotice, Message, Ok, Ping, Pull
from common.kv_transfer.p2p_group import PairGroup, backend_for, dtype_name, host_store
from common.kv_transfer.paged import ByteBudget, StagingBuffer, block_run, gather_blocks

if TYPE_CHECKING:
    from common.kv_transfer.control import ControlPlane

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    request_id: str
    deadline: float | None  # lease; None while layers are being sent
    link: _Link | None = None
    num_blocks: int = 0
    finished: bool = False
    first_token: int = 0
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    queued_layers: set[int] = field(default_factory=set)
    dropped: bool = False
    done_queued: bool = False


@dataclass
class _Job:
    """Send ``layers`` of ``req`` (gathered later unless ``staged``), or its DONE."""

    kind: str  # "layers" | "done"
    req: _Request
    layers: list[int] = field(default_factory=list)
    staged: torch.Tensor | None = None  # [len(layers), 2, blocks, ...] gathered by save_layer
    announced: bool = False  # its notice is out: the bytes must follow, dropped or not

    @property
    def budget(self) -> int:
        return self.staged.numel() * self.staged.element_size() if self.staged is not None else 0


class _KeepAlive:
    """A layer's send handles plus the tensors they read from (must outlive the sends)."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        self.works, self.tensors = works, tensors

    def wait(self, timeout) -> None:
        for work in self.works:
            work.wait(timeout)


@dataclass
class _Link:
    """One consumer's pair, its job queue and its sender thread."""

    pair_id: str
    identity: bytes
    jobs: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    thread: threading.Thread | None = None
    pair: PairGroup | None = None
    broken: bool = False


class KVProducer:
    """The producer half of :class:`~common.kv_transfer.engine.KVTransferEngine`."""

    def __init__(self, layout: KVLayout, config: TransferConfig, stats: TransferStats, host: str,
                 device: str = "cpu") -> None:
        self.layout, self.config, self.stats, self._host = layout, config, stats, host
        self.device = device  # where the KV cache lives: picks gloo or NCCL for the pairs
        self.control: ControlPlane | None = None  # set by the engine once bound
        self._lock = threading.Lock()
        self._requests: dict[str, _Request] = {}
        self._links: dict[str, _Link] = {}
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
            link = req.link
        staged = gather_blocks(kv_layer, ids)
        link.jobs.put(_Job("layers", req, [layer_idx], staged.unsqueeze(0)))

    def finish(self, request_id: str, first_token: int, kv_caches: list[torch.Tensor],
               block_ids: list[int], num_tokens: int) -> None:
        """The prompt is done: start the lease; send whatever the consumer still needs."""
        with self._lock:
            if request_id in self._gone:
                self._freeable.add(request_id)  # aborted or expired while prefill ran
                return
            req = self._requests.setdefault(request_id, _Request(request_id, None))
            req.finished, req.first_token = True, first_token
            req.kv_caches, req.block_ids = kv_caches, list(block_ids)
            req.deadline = time.monotonic() + self.config.lease_s
            self._queue_rest(req)

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
        link = _Link(msg.pair_id, identity)
        link.thread = threading.Thread(target=self._run_link, args=(link, store, msg.backend),
                                       name=f"kv-send-{msg.pair_id[:8]}", daemon=True)
        with self._lock:
            if self._closed:
                return
            self._links[msg.pair_id] = link
        link.thread.start()
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
                req = _Request(msg.request_id, time.monotonic() + self.config.lease_s)
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
    def _queue_rest(self, req: _Request) -> None:
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
            req.link.jobs.put(_Job("layers", req, rest[i:i + per_msg]))
        req.link.jobs.put(_Job("done", req))
        req.done_queued, req.deadline = True, None

    def _fail_request(self, req: _Request, reason: str) -> None:
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

    # ---- sender thread (one per pair) -------------------------------------------------
    def _run_link(self, link: _Link, store, backend: str) -> None:
        # Two sends in flight: layer i+1 is gathered and announced while layer i is on the
        # wire. The next job's notice goes out before this job's bytes, so the consumer can
        # post its receive early. Gathered layers alternate between two staging buffers.
        staging = [StagingBuffer(self.device), StagingBuffer(self.device)]
        inflight: collections.deque[tuple[_KeepAlive, int]] = collections.deque()
        ahead: _Job | None = None
        try:
            link.pair = PairGroup(backend, 0, self._host, store.port, self.config.handshake_timeout_s, store=store,
                                  device=self.device)
            while True:
                if ahead is not None:
                    job, ahead = ahead, None
                else:
                    try:
                        job = link.jobs.get(block=not inflight)
                    except queue.Empty:
                        self._retire(link, inflight)  # nothing new: let the oldest send finish
                        continue
                if job is None:
                    while inflight:
                        self._retire(link, inflight)
                    break
                if len(inflight) >= 2:
                    self._retire(link, inflight)
                try:
                    ahead = link.jobs.get_nowait()
                except queue.Empty:
                    pass
                sent = self._run_job(link, job, staging[0], ahead)
                if sent is not None:
                    inflight.append(sent)
                    staging.reverse()
        except Exception as e:  # PairBrokenError, or a bug: either way this pair is done
            logger.warning("producer: pair %s failed: %s", link.pair_id, e, exc_info=not isinstance(e, PairBrokenError))
            for _, nbytes in inflight:
                self._budget.release(nbytes)
            if ahead is not None:
                self._budget.release(ahead.budget)
            self._link_failed(link, str(e))
        finally:
            if link.pair is not None:
                link.pair.close()

    def _retire(self, link: _Link, inflight: collections.deque) -> None:
        work, nbytes = inflight[0]
        link.pair.wait(work, self.config.timeout_s)
        inflight.popleft()
        self._budget.release(nbytes)

    def _run_job(self, link: _Link, job: _Job, staging: StagingBuffer, ahead: _Job | None) -> tuple | None:
        """Announce (unless done already) and post one job; returns (sends, budget bytes)."""
        req = job.req
        if req.dropped and not job.announced:
            self._budget.release(job.budget)
            return None
        assert self.control is not None and link.pair is not None
        if job.kind == "done":
            self.control.reply(link.identity, Done(request_id=req.request_id, pair_id=link.pair_id,
                                                   first_token=req.first_token))
            with self._lock:
                req.deadline = time.monotonic() + self.config.lease_s  # now waiting for the ACK
            return None
        if not job.announced:
            self._announce(link, job)
        if ahead is not None and ahead.kind == "layers" and not ahead.req.dropped and not ahead.announced:
            self._announce(link, ahead)  # before gathering: the consumer posts both receives now
        parts = self._parts(job, staging)
        try:
            works = [link.pair.send_async(part) for part in parts]
        except PairBrokenError:
            self._budget.release(job.budget)
            raise
        self.stats.add(bytes_sent=sum(p.numel() * p.element_size() for p in parts))
        return (_KeepAlive(works, parts), job.budget)

    def _announce(self, link: _Link, job: _Job) -> None:
        req = job.req
        if job.staged is not None:  # staged during prefill: block_ids are not known yet
            kv, shape, parts = job.staged, list(job.staged.shape[1:]), 1
        else:
            ids = req.block_ids[: req.num_blocks]
            kv = req.kv_caches[job.layers[0]]
            shape = [2, len(ids), *kv.shape[2:]]
            parts = 2 if len(job.layers) == 1 and block_run(ids) else 1
        self.control.reply(link.identity, LayerNotice(request_id=req.request_id, pair_id=link.pair_id,
                                                      layers=job.layers, dtype=dtype_name(kv.dtype),
                                                      shape=shape, parts=parts))
        job.announced = True

    def _parts(self, job: _Job, staging: StagingBuffer) -> list[torch.Tensor]:
        """The tensor(s) to put on the wire, matching what :meth:`_announce` said."""
        if job.staged is not None:
            return [job.staged]
        req = job.req
        ids = req.block_ids[: req.num_blocks]
        run = block_run(ids)
        if run is not None and len(job.layers) == 1:  # keys and values of a run are contiguous: no gather
            kv = req.kv_caches[job.layers[0]]
            return [kv[0, run], kv[1, run]]
        kv0 = req.kv_caches[job.layers[0]]
        out = staging.view(kv0.dtype, (len(job.layers), 2, len(ids), *kv0.shape[2:]))
        for j, layer in enumerate(job.layers):
            gather_blocks(req.kv_caches[layer], ids, out[j])
        return [out]

    def _link_failed(self, link: _Link, reason: str) -> None:
        with self._lock:
            link.broken = True
            self._links.pop(link.pair_id, None)
            for req in [r for r in self._requests.values() if r.link is link]:
                self._fail_request(req, f"transfer failed: {reason}")
        while True:  # release staged bytes of jobs that will never run
            try:
                job = link.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._budget.release(job.budget)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.jobs.put(None)
            if link.pair is not None:
                link.pair.broken = True
        for link in links:
            if link.thread is not None:
                link.thread.join(timeout=self.config.timeout_s + 1)
