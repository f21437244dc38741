"""The consumer's receiver for one producer: everything it does with that producer, on one thread.

Events arrive in order on a queue: a new transfer (handshake and pair build if needed,
then PULL), layer notices (gloo/nccl: receive, two staging buffers deep, then scatter
into the blocks), DONE (report, ACK), errors and aborts. On a ``tcp`` pair the thread
also wakes when the socket is readable: each message's header is in-band, so the bytes
go straight into the blocks the moment they arrive. A failed receive or an unanswered ping
fails every transfer on the link and drops the pair; the next transfer builds a new one.
Every state change of a transfer's record is a call to its owner, the KVConsumer.

On a ``cuda_ipc`` pair the producer writes into our blocks from its own process, so no
transfer there is failed (its blocks handed back for reuse) before the producer confirmed
that it writes no more into them: the link asks it with ABORT, which it answers once its
streams drained, and fails the transfer on the answer or at the answer's deadline
(``_fail_fenced``). That holds on every failure path, a broken link included."""

from __future__ import annotations

import collections
import logging
import math
import queue
import threading
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from common.kv_transfer.config import PairBrokenError, TransferError
from common.kv_transfer.consumer_table import Transfer
from common.kv_transfer.inbox import Inbox
from common.kv_transfer.messages import (UNKNOWN_PAIR, Abort, Ack, Done, Error, LayerNotice, Message, MessageError,
                                         Ping, Pull, decode, encode)
from common.kv_transfer.p2p_group import DTYPE_NAMES, dtype_name
from common.kv_transfer.paged import StagingBuffer, block_run, scatter_blocks
from common.kv_transfer.pair_handshake import open_consumer_pair
from common.kv_transfer.peer_checks import check_done, check_notice
from common.kv_transfer.tcp_pair import KV, Frame, kv_nbytes
from common.kv_transfer.verify import NOT_REQUESTED, STALE, KVRejected, blocks_checksum, check_done_identity

if TYPE_CHECKING:
    from common.kv_transfer.consumer import KVConsumer

logger = logging.getLogger(__name__)


class PairReceiver:
    """Everything this consumer does with one producer, on one thread."""

    def __init__(self, owner: KVConsumer, address: str) -> None:
        self.owner, self.address = owner, address
        self.events = Inbox()
        self.transfers: dict[str, Transfer] = {}
        self.pair = None  # PairGroup | TcpPair | IpcPair
        self.pair_id = ""
        self.transport = ""
        self.checksum = False  # the pair's DONEs carry per-layer checksums (agreed at the handshake)
        self._exported: list[int] = []  # data pointers of the KV cache a cuda_ipc handshake exported
        self.staging: list[StagingBuffer] = []
        self._pushback: collections.deque = collections.deque()  # events read ahead, not yet handled
        self._ping: Future | None = None
        self._fencing = 0  # cuda_ipc transfers failed, waiting for the producer's word before their blocks go
        self._last_ping = 0.0
        self._last_active = time.monotonic()
        self._cache_blocks = 0  # blocks in the KV cache transfers land in: bounds a notice's shape
        self.thread = threading.Thread(target=self._run, name=f"kv-recv-{address}", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        cfg = self.owner.config
        while True:
            try:
                if self._pushback:
                    event = self._pushback.popleft()
                else:
                    tcp = self.pair is not None and self.transport == "tcp"
                    event = self.events.get(cfg.heartbeat_s / 4, self.pair.fileno() if tcp else None)
            except queue.Empty:
                event = ("tick",)
                if self._idle_for() > cfg.peer_idle_s and self.owner.retire(self):
                    break  # nothing to do with this producer for a while: the thread goes
            if event is None:
                break
            try:
                if event[0] != "tick":  # a tick (a quiet queue) only runs the heartbeat
                    self._last_active = time.monotonic()
                    getattr(self, "_on_" + event[0])(*event[1:])
                self._heartbeat()
            except Exception as e:  # TransferError, or a bad notice: fail what waits, rebuild later
                logger.warning("consumer: link to %s failed: %s", self.address, e,
                               exc_info=not isinstance(e, TransferError))
                reason = f"data plane to producer {self.address} failed: {e}" \
                    if isinstance(e, PairBrokenError) else str(e)
                self._fail_all(reason)
        self._close_pair()
        self.events.close()

    def _idle_for(self) -> float:
        """Seconds with no transfer and no pair (an idle but built pair is kept: it is costly)."""
        busy = self.transfers or self.pair is not None or self._fencing
        return 0.0 if busy else time.monotonic() - self._last_active

    # ---- events --------------------------------------------------------------------
    def _on_data(self) -> None:
        """tcp: the next in-band message (or the producer's close) is readable."""
        assert self.pair is not None
        try:
            frame = self.pair.recv_frame(self.owner.config.timeout_s)
        except TransferError:
            if self.transfers:
                raise
            logger.info("consumer: idle pair to %s closed; the next request builds a new one", self.address)
            self._close_pair()
            return
        if frame.kind == KV:
            self._land_frame(frame)
            return
        try:
            msg = decode(frame.payload)
        except MessageError as e:
            raise TransferError(f"bad in-band message from {self.address}: {e}") from e
        if isinstance(msg, Done) and msg.pair_id == self.pair_id:
            self._finish(msg)

    def _land_frame(self, frame: Frame) -> None:
        """Receive a tcp message straight into its request's blocks, or drop its bytes when
        nobody waits for them (aborted) or they do not fit (the request fails)."""
        t = self.transfers.get(frame.request_id)
        fits, reason = False, ""
        if t is not None:
            self.owner.table.first_byte(t)
            bad_layer = not all(0 <= x < len(t.kv_caches) for x in frame.layers)
            if frame.num_blocks > len(t.block_ids) or bad_layer:
                reason = f"layers {list(frame.layers)}: {frame.num_blocks} blocks do not fit the request"
            elif kv_nbytes(t.kv_caches, frame.layers, frame.num_blocks) != frame.nbytes:
                reason = f"layers {list(frame.layers)}: {frame.nbytes} bytes do not fit"
            else:
                fits = True
        timeout = self.owner.config.timeout_s
        if fits:
            self.pair.recv_kv(t.kv_caches, frame.layers, t.block_ids[: frame.num_blocks], timeout, self.staging[0])
        else:
            self.pair.discard(frame.nbytes, timeout)
        self.owner.stats.add(bytes_received=frame.nbytes)
        if t is None:
            return
        if reason:
            self.owner.failed(self.transfers.pop(t.request_id), reason)
            return
        self._landed(t, frame.layers, frame.num_blocks, frame.nbytes)

    def _on_new(self, t: Transfer) -> None:
        if self.pair is not None and not getattr(self.pair, "alive", lambda: True)():
            logger.info("consumer: pair to %s closed while idle; building a new one", self.address)
            self._close_pair()
        if self.pair is None:
            try:
                self._open_pair(t.kv_caches)
            except TransferError as e:
                self.owner.failed(t, str(e))
                return
        if self.transport == "cuda_ipc" and [x.data_ptr() for x in t.kv_caches] != self._exported:
            self.owner.failed(t, "a cuda_ipc pair writes into the KV cache exported at its handshake; "
                                "this request names another")
            return
        self.transfers[t.request_id] = t
        self._cache_blocks = t.kv_caches[0].shape[1]
        self.owner.table.pull_sent(t)
        pull = Pull(request_id=t.request_id, pair_id=self.pair_id, num_tokens=t.num_tokens,
                    num_blocks=self.owner.num_blocks(t.num_tokens), block_ids=t.block_ids,
                    first_block=t.first_block, nonce=t.nonce)
        if self.transport == "tcp":
            # straight to the producer's sender thread, which reads the socket between sends: no
            # control-plane hops. No answer: a refusal comes back as an Error notice, as a late one would.
            self.pair.send_message(encode(pull))
            return
        fut = self.owner.control.request(self.address, pull, self.owner.config.timeout_s)
        pair_id = self.pair_id
        fut.add_done_callback(lambda f: self.events.put(("pull_result", t.request_id, pair_id, f)))

    def _on_pull_result(self, request_id: str, pair_id: str, fut: Future) -> None:
        try:
            reply = fut.result()
        except TransferError as e:
            raise TransferError(f"producer {self.address} did not answer PULL: {e}") from e
        if not isinstance(reply, Error) or request_id not in self.transfers:
            return
        t = self.transfers.pop(request_id)
        if reply.reason == UNKNOWN_PAIR and self.owner.table.retry(t):  # the producer restarted while the pair idled
            if pair_id == self.pair_id:
                self._close_pair()
            self._on_new(t)
            return
        self.owner.failed(t, f"producer refused: {reply.reason}")

    def _on_abort(self, request_id: str) -> None:
        # on this thread, between events: no receive into the request's blocks is posted now
        if self.transfers.pop(request_id, None) is None:
            self.owner.abort_stopped(request_id)
        elif self.transport == "cuda_ipc":  # the producer writes into our blocks: wait for its word
            self._fencing += 1
            fut = self.owner.control.request(self.address, Abort(request_id=request_id),
                                             self.owner.config.timeout_s)
            fut.add_done_callback(lambda f: self.events.put(("abort_fenced", request_id, f)))
        else:
            self.owner.control.send(self.address, Abort(request_id=request_id))
            self.owner.abort_stopped(request_id)

    def _fail_fenced(self, t: Transfer, reason: str) -> None:
        """Fail ``t``; on a cuda_ipc pair only once the producer confirmed it writes no more
        into its blocks (a copy may be on its stream), or its answer's deadline passed."""
        if self.transport != "cuda_ipc":
            self.owner.failed(t, reason)
            return
        self._fencing += 1
        fut = self.owner.control.request(self.address, Abort(request_id=t.request_id),
                                         self.owner.config.timeout_s)
        fut.add_done_callback(lambda f: self.events.put(("fenced_fail", t, reason)))

    def _on_fenced_fail(self, t: Transfer, reason: str) -> None:
        self._fencing -= 1
        self.owner.failed(t, reason)

    def _on_abort_fenced(self, request_id: str, fut: Future) -> None:
        self._fencing -= 1
        self.owner.abort_stopped(request_id)
        if fut.exception() is not None:  # no answer: treat the producer as gone, drop the pair
            raise TransferError(f"producer {self.address} did not confirm the abort: {fut.exception()}")

    def _on_notice(self, msg: Message) -> None:
        if isinstance(msg, Error):
            t = self.transfers.pop(msg.request_id, None)
            if t is not None:
                self._fail_fenced(t, f"producer: {msg.reason}")
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
        """Post the receive(s) for one message: straight into the blocks when the sizes match
        (tcp: any blocks; gloo/nccl: a run sent as keys then values), else into a staging
        buffer. The sizes always come from the notice: gloo aborts the process on a size
        mismatch, and a socket would fall out of step."""
        assert self.pair is not None
        t = self.transfers.get(msg.request_id)
        if t is not None:
            self.owner.table.first_byte(t)
        bad = check_notice(msg, self.owner.layout, len(t.block_ids) if t is not None else self._cache_blocks)
        if bad is not None:  # its bytes cannot be received in step: the pair goes
            raise TransferError(f"bad layer notice from producer {self.address}: {bad}")
        fits = t is not None and len(t.block_ids) >= msg.shape[1] \
            and list(msg.shape[2:]) == list(t.kv_caches[0].shape[2:]) and msg.shape[0] == 2 \
            and dtype_name(t.kv_caches[0].dtype) == msg.dtype
        if self.transport == "cuda_ipc":  # the producer already wrote into the blocks
            return msg, None, []
        run = block_run(t.block_ids[: msg.shape[1]]) if fits else None
        if msg.parts == 2 and run is not None and t.kv_caches[0].is_contiguous():  # (a head slice is not)
            kv = t.kv_caches[msg.layers[0]]
            return msg, None, [self.pair.recv_async([kv[0, run], kv[1, run]])]
        self.staging.reverse()  # two buffers: one being received, one being scattered
        buf = self.staging[0].view(DTYPE_NAMES[msg.dtype], (len(msg.layers), *msg.shape))
        parts = [buf[0, 0], buf[0, 1]] if msg.parts == 2 else [buf]
        return msg, buf, [self.pair.recv_async(parts)]

    def _land(self, msg: LayerNotice, buf: torch.Tensor | None) -> None:
        nbytes = len(msg.layers) * math.prod(msg.shape) * DTYPE_NAMES[msg.dtype].itemsize
        self.owner.stats.add(bytes_received=nbytes)
        t = self.transfers.get(msg.request_id)
        if t is None:
            return  # aborted meanwhile: bytes discarded
        if buf is not None:
            ids = t.block_ids[: msg.shape[1]]
            if tuple(msg.shape[2:]) != tuple(t.kv_caches[0].shape[2:]) or len(ids) != msg.shape[1]:
                reason = f"layers {msg.layers}: unexpected shape {msg.shape}"
                self.owner.failed(self.transfers.pop(t.request_id), reason)
                return
            for j, layer in enumerate(msg.layers):
                scatter_blocks(t.kv_caches[layer], ids, buf[j])
        self._landed(t, msg.layers, msg.shape[1], nbytes)

    def _landed(self, t: Transfer, layers: list[int] | tuple[int, ...], num_blocks: int, nbytes: int) -> None:
        """``layers`` of ``t`` are in its first ``num_blocks`` blocks now."""
        # the checksum is over the blocks as they now hold the bytes, in the sender's order
        checksums = {}
        if self.checksum and self.transport != "cuda_ipc":
            ids = t.block_ids[:num_blocks]
            checksums = {layer: blocks_checksum(t.kv_caches[layer], ids) for layer in layers}
        self.owner.table.layers_landed(t, layers, nbytes, checksums)

    def _finish(self, msg: Done) -> None:
        t = self.transfers.pop(msg.request_id, None)
        if t is None:  # aborted meanwhile, or never asked for: nothing of it is used
            logger.warning("consumer: DONE for %s from %s, which no transfer waits for", msg.request_id, self.address)
            self.owner.stats.reject(NOT_REQUESTED)
            return
        bad = check_done(msg, self.owner.vocab_size)
        if bad is not None:  # this request fails alone; the pair and the engine go on
            logger.warning("consumer: bad DONE for %s from %s: %s", msg.request_id, self.address, bad)
            self.owner.failed(t, f"producer {self.address} sent a bad DONE: {bad}")
            self._ack(msg.request_id)
            return
        try:
            check_done_identity(msg, nonce=t.nonce, layout=self.owner.layout,
                                num_blocks=self.owner.num_blocks(t.num_tokens) - t.first_block,
                                layers=t.layers, nbytes=t.nbytes, checksums=t.checksums if self.checksum else None)
        except KVRejected as e:  # partial, stale or damaged: decode must not run on it
            logger.warning("consumer: KV of %s from %s rejected (%s): %s", msg.request_id, self.address, e.reason, e)
            self.owner.stats.reject(e.reason)
            self.owner.failed(t, f"KV from producer {self.address} rejected ({e.reason}): {e}")
            if e.reason == STALE:
                return  # not this transfer's DONE: no ACK on its behalf
        else:
            self.owner.landed(t, msg.first_token, msg.first_logprobs, msg.choices, msg.cached_tokens)
        self._ack(msg.request_id)  # after landed(): the engine sees the request first

    def _ack(self, request_id: str) -> None:
        ack = Ack(request_id=request_id)
        if self.transport == "tcp":
            self.pair.send_message(encode(ack))
        else:
            self.owner.control.send(self.address, ack)

    # ---- pair and liveness --------------------------------------------------------------
    def _open_pair(self, kv_caches: list[torch.Tensor]) -> None:
        owner = self.owner
        opened = open_consumer_pair(owner.control, self.address, owner.layout, owner.transport, owner.config,
                                    kv_caches, consumer=owner.address)
        self.pair, self.pair_id, self.transport = opened.pair, opened.pair_id, opened.transport
        self.checksum, self._exported = opened.checksum, opened.exported
        self.staging = [StagingBuffer(kv_caches[0].device), StagingBuffer(kv_caches[0].device)]
        logger.info("consumer: pair %s to %s uses %s", self.pair_id[:8], self.address, self.transport)

    def _heartbeat(self) -> None:
        cfg = self.owner.config
        if self._ping is not None and self._ping.done():
            fut, self._ping = self._ping, None
            if fut.exception() is not None:
                raise TransferError(f"producer {self.address} stopped answering: {fut.exception()}")
        now = time.monotonic()
        # lease + timeout with no layer landing (since the request or its latest layer: a slow link
        # that keeps moving is not cut off) means the producer is gone
        limit = cfg.lease_s + cfg.timeout_s
        for t in [t for t in self.transfers.values() if now - (t.last_landed or t.started) > limit]:
            self._fail_fenced(self.transfers.pop(t.request_id), "timed out waiting for the producer")
        # a built pair is pinged even when idle: its control connection stays in use (the control
        # plane closes idle ones) and a producer that died meanwhile is noticed before the next request
        due = self._ping is None and now - self._last_ping >= cfg.heartbeat_s
        if due and (self.transfers or self.pair is not None):
            self._last_ping = now
            self._ping = self.owner.control.request(self.address, Ping(pair_id=self.pair_id), cfg.timeout_s)

    def _fail_all(self, reason: str) -> None:
        """Fail every transfer on the link and drop the pair (cuda_ipc: each fenced, as above)."""
        for t in self.transfers.values():
            self._fail_fenced(t, reason)
        self.transfers.clear()
        self._close_pair()
        self._ping = None

    def _close_pair(self) -> None:
        if self.pair is not None:
            self.pair.close()
        self.pair, self.pair_id, self.transport = None, "", ""
