"""The consumer's receiver for one producer: everything it does with that producer, on
one thread.

Events arrive in order on a queue: a new transfer (handshake and pair build if needed,
then PULL), layer notices (receive, two staging buffers deep, then scatter into the
blocks), DONE (ACK, report), errors and aborts. A failed receive or an unanswered ping
fails every transfer on the link and drops the pair; the next transfer builds a new one.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
import uuid
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.kv_transfer.config import TransferError
from common.kv_transfer.messages import Abort, Ack, Done, Error, Handshake, HandshakeOk, LayerNotice, Message, Ping, Pull
from common.kv_transfer.p2p_group import DTYPE_NAMES, PairGroup, backend_for, dtype_name
from common.kv_transfer.paged import StagingBuffer, block_run, scatter_blocks

if TYPE_CHECKING:
    from common.kv_transfer.consumer import KVConsumer

logger = logging.getLogger(__name__)


@dataclass
class Transfer:
    request_id: str
    block_ids: list[int]
    num_tokens: int
    kv_caches: list[torch.Tensor]
    started: float = field(default_factory=time.monotonic)
    layers: set[int] = field(default_factory=set)
    nbytes: int = 0


class PairReceiver:
    """Everything this consumer does with one producer, on one thread."""

    def __init__(self, owner: KVConsumer, address: str) -> None:
        self.owner, self.address = owner, address
        self.events: queue.SimpleQueue = queue.SimpleQueue()
        self.transfers: dict[str, Transfer] = {}
        self.pair: PairGroup | None = None
        self.pair_id = ""
        self.staging: list[StagingBuffer] = []
        self._pushback: collections.deque = collections.deque()  # events read ahead, not yet handled
        self._ping: Future | None = None
        self._last_ping = 0.0
        self.thread = threading.Thread(target=self._run, name=f"kv-recv-{address}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cfg = self.owner.config
        while True:
            try:
                event = self._pushback.popleft() if self._pushback else self.events.get(timeout=cfg.heartbeat_s / 4)
            except queue.Empty:
                event = ("tick",)
            if event is None:
                break
            try:
                getattr(self, "_on_" + event[0])(*event[1:])
                self._heartbeat()
            except Exception as e:  # TransferError, or a bad notice: fail what waits, rebuild later
                logger.warning("consumer: link to %s failed: %s", self.address, e,
                               exc_info=not isinstance(e, TransferError))
                self._fail_all(str(e))
        self._close_pair()

    # ---- events --------------------------------------------------------------------
    def _on_tick(self) -> None:
        pass

    def _on_new(self, t: Transfer) -> None:
        if self.pair is None:
            try:
                self._open_pair(t.kv_caches[0].device)
            except TransferError as e:
                self.owner._fail(t, str(e))
                return
        self.transfers[t.request_id] = t
        fut = self.owner.control.request(self.address, Pull(request_id=t.request_id, pair_id=self.pair_id,
                                                            num_blocks=self.owner._num_blocks(t.num_tokens),
                                                            num_tokens=t.num_tokens), self.owner.config.timeout_s)
        fut.add_done_callback(lambda f: self.events.put(("pull_result", t.request_id, f)))

    def _on_pull_result(self, request_id: str, fut: Future) -> None:
        try:
            reply = fut.result()
        except TransferError as e:
            raise TransferError(f"producer {self.address} did not answer PULL: {e}") from e
        if isinstance(reply, Error) and request_id in self.transfers:
            self.owner._fail(self.transfers.pop(request_id), f"producer refused: {reply.reason}")

    def _on_abort(self, request_id: str) -> None:
        # on this thread, between events: no receive into the request's blocks is posted now
        if self.transfers.pop(request_id, None) is not None:
            self.owner.control.send(self.address, Abort(request_id=request_id))
        self.owner._abort_stopped(request_id)

    def _on_notice(self, msg: Message) -> None:
        if isinstance(msg, Error):
            t = self.transfers.pop(msg.request_id, None)
            if t is not None:
                self.owner._fail(t, f"producer: {msg.reason}")
        elif getattr(msg, "pair_id", None) != self.pair_id or self.pair is None:
            return  # a notice from a pair already torn down
        elif isinstance(msg, LayerNotice):
            self._receive_layers(msg)
        elif isinstance(msg, Done):
            self._finish(msg)

    def _receive_layers(self, first: LayerNotice) -> None:
        """Receive ``first`` and the layer notices queued behind it, two staging buffers deep:
        the next receive is posted before a landed layer is scattered into its blocks."""
        assert self.pair is not None
        timeout = self.owner.config.timeout_s
        posted = collections.deque([self._post_recv(first)])
        while posted:
            if len(posted) < 2:
                self._look_ahead(posted)
            msg, buf, works = posted.popleft()
            for work in works:  # always wait: keeps the FIFO in step
                self.pair.wait(work, timeout)
            if not posted:  # the other buffer is free: post the next before scattering this one
                self._look_ahead(posted)
            self._land(msg, buf)

    def _look_ahead(self, posted: collections.deque) -> None:
        if self._pushback:
            return  # something else is due first, in order
        try:
            nxt = self.events.get_nowait()
        except queue.Empty:
            return
        if isinstance(nxt, tuple) and nxt[0] == "notice" and isinstance(nxt[1], LayerNotice) \
                and nxt[1].pair_id == self.pair_id:
            posted.append(self._post_recv(nxt[1]))
        else:
            self._pushback.append(nxt)

    def _post_recv(self, msg: LayerNotice) -> tuple[LayerNotice, torch.Tensor | None, list]:
        """Post the receive(s) for one layer: straight into the blocks when they are a run and
        the producer sends keys and values apart, else into a staging buffer. The sizes
        always come from the notice: gloo aborts the process on a size mismatch."""
        assert self.pair is not None
        t = self.transfers.get(msg.request_id)
        ids = t.block_ids[: msg.shape[1]] if t is not None else []
        run = block_run(ids) if len(ids) == msg.shape[1] else None
        kv = t.kv_caches[msg.layers[0]] if t is not None else None
        if msg.parts == 2 and run is not None and kv is not None and list(kv[:, run].shape) == msg.shape \
                and dtype_name(kv.dtype) == msg.dtype:
            return msg, None, [self.pair.recv_async(kv[0, run]), self.pair.recv_async(kv[1, run])]
        self.staging.reverse()  # two buffers: one being received, one being scattered
        buf = self.staging[0].view(DTYPE_NAMES[msg.dtype], (len(msg.layers), *msg.shape))
        parts = [buf[0, 0], buf[0, 1]] if msg.parts == 2 else [buf]
        return msg, buf, [self.pair.recv_async(part) for part in parts]

    def _land(self, msg: LayerNotice, buf: torch.Tensor | None) -> None:
        nbytes = len(msg.layers) * torch.empty((), dtype=DTYPE_NAMES[msg.dtype]).element_size()
        for d in msg.shape:
            nbytes *= d
        self.owner.stats.add(bytes_received=nbytes)
        t = self.transfers.get(msg.request_id)
        if t is None:
            return  # aborted meanwhile: bytes discarded
        if buf is not None:
            ids = t.block_ids[: msg.shape[1]]
            if tuple(msg.shape[2:]) != tuple(t.kv_caches[0].shape[2:]) or len(ids) != msg.shape[1]:
                self.owner._fail(self.transfers.pop(t.request_id), f"layers {msg.layers}: unexpected shape {msg.shape}")
                return
            for j, layer in enumerate(msg.layers):
                scatter_blocks(t.kv_caches[layer], ids, buf[j])
        t.layers.update(msg.layers)
        t.nbytes += nbytes

    def _finish(self, msg: Done) -> None:
        t = self.transfers.pop(msg.request_id, None)
        if t is None:
            return
        self.owner.control.send(self.address, Ack(request_id=msg.request_id))
        missing = self.owner.layout.num_layers - len(t.layers)
        if missing:
            self.owner._fail(t, f"DONE with {missing} layers missing")
        else:
            self.owner._done(t, msg.first_token)

    # ---- pair and liveness --------------------------------------------------------------
    def _open_pair(self, device: torch.device) -> None:
        cfg, owner = self.owner.config, self.owner
        pair_id = uuid.uuid4().hex
        backend = backend_for(device)
        fut = owner.control.request(self.address, Handshake(pair_id=pair_id, layout=owner.layout.to_dict(),
                                                            backend=backend), cfg.handshake_timeout_s)
        try:
            reply = fut.result(timeout=cfg.handshake_timeout_s + 1)
        except Exception as e:
            raise TransferError(f"producer {self.address} unreachable: {e}") from e
        if isinstance(reply, Error):
            raise TransferError(reply.reason)
        if not isinstance(reply, HandshakeOk):
            raise TransferError(f"unexpected handshake reply {reply.CMD}")
        self.pair = PairGroup(backend, 1, reply.store_host, reply.store_port, cfg.handshake_timeout_s,
                              device=str(device))
        self.pair_id, self.staging = pair_id, [StagingBuffer(device), StagingBuffer(device)]

    def _heartbeat(self) -> None:
        cfg = self.owner.config
        if self._ping is not None and self._ping.done():
            fut, self._ping = self._ping, None
            if fut.exception() is not None:
                raise TransferError(f"producer {self.address} stopped answering: {fut.exception()}")
        now = time.monotonic()
        for t in [t for t in self.transfers.values() if now - t.started > cfg.lease_s + cfg.timeout_s]:
            self.owner._fail(self.transfers.pop(t.request_id), "timed out waiting for the producer")
        if self.transfers and self._ping is None and now - self._last_ping >= cfg.heartbeat_s:
            self._last_ping = now
            self._ping = self.owner.control.request(self.address, Ping(), cfg.timeout_s)

    def _fail_all(self, reason: str) -> None:
        for t in self.transfers.values():
            self.owner._fail(t, reason)
        self.transfers.clear()
        self._close_pair()
        self._ping = None

    def _close_pair(self) -> None:
        if self.pair is not None:
            self.pair.close()
        self.pair, self.pair_id = None, ""
