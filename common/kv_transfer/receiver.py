"""The consumer's link to one producer: everything it does with that producer, on the I/O thread.

There is no thread per producer: the endpoint's one I/O thread (control.py) runs every link.
Work reaches a link as calls on that thread, in order: a new transfer (:meth:`new`: pair
built if needed, then PULL), an abort, the producer's control messages (:meth:`notice`),
a tcp pair's socket becoming readable (:meth:`readable`) and a periodic :meth:`tick`
(pings, deadlines, idle retirement). Nothing here waits on the network:

- building a pair (handshake, connect) runs on a short-lived thread, whose result comes back
  as a call; transfers asked for meanwhile wait for it;
- a ``tcp`` pair is read without blocking (tcp_pair.FrameReader): each message's header is
  in-band, so its bytes go straight into the blocks as they arrive;
- a ``gloo``/``nccl`` pair's receives are posted here, two staging buffers deep, and waited on
  by the pair's :class:`~common.kv_transfer.waiter.Waiter` thread (torch's gloo work cannot be
  polled), whose word comes back as a call; the producer's notices (LAYER, DONE, ERROR) and aborts on such a pair are handled
  strictly in arrival order, each after the receives posted before it landed.

A failed receive or an unanswered ping fails every transfer on the link and drops the pair;
the next transfer builds a new one. Every state change of a transfer's record is a call to
its owner, the KVConsumer.

On a ``cuda_ipc`` pair the producer writes into our blocks from its own process, so no
transfer there is failed (its blocks handed back for reuse) before the producer confirmed
that it writes no more into them: the link asks it with ABORT, which it answers once its
streams drained, and fails the transfer on the answer or at the answer's deadline
(``_fail_fenced``). That holds on every failure path, a broken link included."""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING

import torch

from common.kv_transfer.config import ConnectionReopened, PairBrokenError, TransferError
from common.kv_transfer.consumer_table import Transfer
from common.kv_transfer.messages import (UNKNOWN_PAIR, Abort, Ack, Done, Error, LayerNotice, Message, MessageError,
                                         Ping, Pull, decode, encode)
from common.kv_transfer.p2p_group import DTYPE_NAMES, dtype_name
from common.kv_transfer.paged import StagingBuffer, block_run, scatter_blocks
from common.kv_transfer.pair_handshake import OpenedPair, open_consumer_pair
from common.kv_transfer.peer_checks import check_done, check_notice
from common.kv_transfer.tcp_pair import Frame, FrameReader, PeerClosedError, kv_nbytes, kv_views, scratch_views
from common.kv_transfer.waiter import Waiter
from common.kv_transfer.verify import NOT_REQUESTED, STALE, KVRejected, blocks_checksum, check_done_identity

if TYPE_CHECKING:
    from common.kv_transfer.consumer import KVConsumer

logger = logging.getLogger(__name__)


class PairReceiver:
    """Everything this consumer does with one producer; every method runs on the I/O thread."""

    def __init__(self, owner: KVConsumer, address: str) -> None:
        self.owner, self.address = owner, address
        self.queued = 0  # calls posted to this link and not yet run (the owner's lock guards it)
        self.transfers: dict[str, Transfer] = {}
        self.pair = None  # PairGroup | TcpPair | IpcPair
        self.pair_id = ""
        self.transport = ""
        self.checksum = False  # the pair's DONEs carry per-layer checksums (agreed at the handshake)
        self._exported: list[int] = []  # data pointers of the KV cache a cuda_ipc handshake exported
        self.staging: list[StagingBuffer] = []
        self._building: list[Transfer] | None = None  # transfers waiting for the pair being built
        self._reader: FrameReader | None = None  # tcp
        self._fd = -1  # the tcp pair's socket, watched by the I/O thread
        self._waiter: Waiter | None = None  # gloo/nccl
        self._in_order: collections.deque = collections.deque()  # gloo/nccl: notices and aborts, in order
        self._posted: collections.deque = collections.deque()  # gloo/nccl: (notice, staging or None) in flight
        self._ping: Future | None = None
        self._fencing = 0  # cuda_ipc transfers failed, waiting for the producer's word before their blocks go
        self._last_ping = 0.0
        self._last_active = time.monotonic()
        self._next_tick = 0.0
        self._cache_blocks = 0  # blocks in the KV cache transfers land in: bounds a notice's shape
        self.closed = False

    # ---- entry points (I/O thread) -------------------------------------------------------
    def run(self, step: Callable, *args) -> None:
        """Run one step of this link; an error in it fails what waits (rebuilt by the next transfer)."""
        if self.closed:
            if args and isinstance(args[0], OpenedPair):
                args[0].pair.close()  # built after the link closed
            return
        self._last_active = time.monotonic()
        try:
            step(*args)
        except Exception as e:  # TransferError, or a bad notice: fail what waits, rebuild later
            logger.warning("consumer: link to %s failed: %s", self.address, e,
                           exc_info=not isinstance(e, TransferError))
            reason = f"data plane to producer {self.address} failed: {e}" \
                if isinstance(e, PairBrokenError) else str(e)
            self._fail_all(reason)

    def tick(self, now: float) -> bool:
        """Pings and deadlines, a few times a heartbeat; True once the link retired (idle)."""
        if self.closed or now < self._next_tick:
            return self.closed
        cfg = self.owner.config
        self._next_tick = now + cfg.heartbeat_s / 4
        if self._idle_for(now) > cfg.peer_idle_s and self.owner.retire(self):
            self.close()
            return True
        self.run(self._heartbeat, now)
        return False

    def close(self) -> None:
        self._close_pair()
        self.closed = True

    def _idle_for(self, now: float) -> float:
        """Seconds with no transfer and no pair (an idle but built pair is kept: it is costly)."""
        busy = self.transfers or self.pair is not None or self._fencing or self._building is not None
        return 0.0 if busy else now - self._last_active

    # ---- a new transfer ------------------------------------------------------------------
    def new(self, t: Transfer) -> None:
        if self.pair is not None and not getattr(self.pair, "alive", lambda: True)():
            logger.info("consumer: pair to %s closed while idle; building a new one", self.address)
            self._close_pair()
        if self._building is not None:
            self._building.append(t)
        elif self.pair is None:
            self._building = [t]
            threading.Thread(target=self._build, args=(t.kv_caches,), name=f"kv-pair-{self.address}",
                             daemon=True).start()
        else:
            self._pull(t)

    def _build(self, kv_caches: list[torch.Tensor]) -> None:
        """Off the I/O thread: handshake and build the pair (rank 1), then hand it over."""
        owner = self.owner
        try:
            opened: OpenedPair | TransferError = open_consumer_pair(
                owner.control, self.address, owner.layout, owner.transport, owner.config, kv_caches,
                consumer=owner.address)
        except TransferError as e:
            opened = e
        owner.post(self, self._built, opened, kv_caches[0].device)

    def _built(self, opened: OpenedPair | TransferError, device: torch.device) -> None:
        """The pair is in (``device``: where its cache lives, for the staging buffers), or failed."""
        waiting, self._building = self._building or [], None
        if isinstance(opened, TransferError):
            for t in waiting:
                self.owner.failed(t, str(opened))
            return
        self.pair, self.pair_id, self.transport = opened.pair, opened.pair_id, opened.transport
        self.checksum, self._exported = opened.checksum, opened.exported
        self.staging = [StagingBuffer(device), StagingBuffer(device)]
        logger.info("consumer: pair %s to %s uses %s", self.pair_id[:8], self.address, self.transport)
        if self.transport == "tcp":
            self._reader = FrameReader(self.pair, self._on_kv, self._on_message)
            self._fd = self.pair.fileno()
            self.owner.control.watch(self._fd, lambda: self.run(self._readable))
        elif self.transport in ("gloo", "nccl"):
            self._waiter = Waiter(f"recv-{self.pair_id[:8]}", self.owner.control.call_soon)
        for t in waiting:
            self._pull(t)

    def _pull(self, t: Transfer) -> None:
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
            # in-band, straight to the producer's I/O thread, which reads the pair's socket: no
            # control-plane hops. No answer: a refusal comes back as an Error notice, as a late one would.
            self.pair.send_message(encode(pull))
            return
        fut = self.owner.control.request(self.address, pull, self.owner.config.timeout_s)
        pair_id = self.pair_id
        fut.add_done_callback(lambda f: self.owner.post(self, self._pull_result, t.request_id, pair_id, f))

    def _pull_result(self, request_id: str, pair_id: str, fut: Future) -> None:
        try:
            reply = fut.result()
        except ConnectionReopened as e:
            # Another request to the producer went unanswered (a producer that restarted while the
            # pair idled: its old socket's ping), so the control plane opened a fresh connection
            # and this PULL, sent on the old one, was lost with it. The only transfer on the link:
            # asked again once, on a new pair, as for UNKNOWN_PAIR below. Else the link fails.
            t = self.transfers.get(request_id)
            if t is None or set(self.transfers) != {request_id} or not self.owner.table.retry(t):
                raise TransferError(f"producer {self.address} did not answer PULL: {e}") from e
            self._ask_again(self.transfers.pop(request_id), pair_id)
            return
        except TransferError as e:
            raise TransferError(f"producer {self.address} did not answer PULL: {e}") from e
        if not isinstance(reply, Error) or request_id not in self.transfers:
            return
        t = self.transfers.pop(request_id)
        if reply.reason == UNKNOWN_PAIR and self.owner.table.retry(t):  # the producer restarted while the pair idled
            self._ask_again(t, pair_id)
            return
        self.owner.failed(t, f"producer refused: {reply.reason}")

    def _ask_again(self, t: Transfer, pair_id: str) -> None:
        """``t`` (its one retry taken) asked again on a new pair: the pair its PULL went out on is
        closed first, if it still is this link's."""
        if pair_id == self.pair_id:
            self._close_pair()
        self.new(t)

    # ---- aborts and failures ---------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        if self._posted:  # a receive may be writing into its blocks: after the ones posted before
            self._in_order.append(("abort", request_id))
            return
        waiting = self._building or []
        if any(t.request_id == request_id for t in waiting):  # nothing pulled yet: only tell the producer
            self._building = [t for t in waiting if t.request_id != request_id]
            self.owner.control.send(self.address, Abort(request_id=request_id))
            self.owner.abort_stopped(request_id)
            return
        if self._take(request_id) is None:
            self.owner.abort_stopped(request_id)
        elif self.transport == "cuda_ipc":  # the producer writes into our blocks: wait for its word
            self._fencing += 1
            fut = self.owner.control.request(self.address, Abort(request_id=request_id),
                                             self.owner.config.timeout_s)
            fut.add_done_callback(lambda f: self.owner.post(self, self._abort_fenced, request_id, f))
        else:
            self.owner.control.send(self.address, Abort(request_id=request_id))
            self.owner.abort_stopped(request_id)

    def _take(self, request_id: str) -> Transfer | None:
        """Remove a transfer from the link; a tcp payload landing in its blocks goes to scratch
        from here on, so its blocks may be reused at once."""
        t = self.transfers.pop(request_id, None)
        if t is not None and self._reader is not None and self._reader.request_id == request_id:
            self._reader.divert()
        return t

    def _fail_fenced(self, t: Transfer, reason: str, fence: bool | None = None) -> None:
        """Fail ``t``; on a cuda_ipc pair (``fence``) only once the producer confirmed it writes no
        more into its blocks (a copy may be on its stream), or its answer's deadline passed."""
        if not (self.transport == "cuda_ipc" if fence is None else fence):
            self.owner.failed(t, reason)
            return
        self._fencing += 1
        fut = self.owner.control.request(self.address, Abort(request_id=t.request_id),
                                         self.owner.config.timeout_s)
        fut.add_done_callback(lambda f: self.owner.post(self, self._fenced_fail, t, reason))

    def _fenced_fail(self, t: Transfer, reason: str) -> None:
        self._fencing -= 1
        self.owner.failed(t, reason)

    def _abort_fenced(self, request_id: str, fut: Future) -> None:
        self._fencing -= 1
        self.owner.abort_stopped(request_id)
        if fut.exception() is not None:  # no answer: treat the producer as gone, drop the pair
            raise TransferError(f"producer {self.address} did not confirm the abort: {fut.exception()}")

    def _fail_all(self, reason: str) -> None:
        """Drop the pair, then fail every transfer on the link (cuda_ipc: each fenced, as above)."""
        fence = self.transport == "cuda_ipc"
        failing, aborts = list(self.transfers.values()), [x for kind, x in self._in_order if kind == "abort"]
        self.transfers.clear()
        self._in_order.clear()
        self._close_pair()
        for t in failing:
            self._fail_fenced(t, reason, fence)
        for request_id in aborts:  # their transfers failed above: nothing writes into their blocks
            self.owner.abort_stopped(request_id)
        self._ping = None

    # ---- the producer's control messages -----------------------------------------------------
    def notice(self, msg: Message) -> None:
        if self.transport in ("gloo", "nccl"):  # in order behind the receives posted before it
            self._in_order.append(("notice", msg))
            self._advance()
        else:
            self._handle(msg)

    def _handle(self, msg: Message) -> None:
        if isinstance(msg, Error):
            t = self._take(msg.request_id)
            if t is not None:
                self._fail_fenced(t, f"producer: {msg.reason}")
        elif getattr(msg, "pair_id", None) != self.pair_id or self.pair is None:
            return  # a notice from a pair already torn down
        elif isinstance(msg, LayerNotice):
            self._post_recv(msg)
        elif isinstance(msg, Done):
            self._finish(msg)

    def _advance(self) -> None:
        """gloo/nccl: handle what is next in order: a layer notice is posted while fewer than two
        receives are in flight; anything else waits until every receive before it landed."""
        while self._in_order:
            kind, item = self._in_order[0]
            is_layer = kind == "notice" and isinstance(item, LayerNotice) and item.pair_id == self.pair_id
            if self._posted and (len(self._posted) >= 2 or not is_layer):
                return
            self._in_order.popleft()
            if kind == "abort":
                self.abort(item)
            else:
                self._handle(item)

    def _post_recv(self, msg: LayerNotice) -> None:
        """Post the receive(s) for one message: straight into the blocks when the sizes match
        (a run sent as keys then values), else into a staging buffer. The sizes always come
        from the notice: gloo aborts the process on a size mismatch. cuda_ipc: the producer
        already wrote the blocks, the layers land now."""
        assert self.pair is not None
        t = self.transfers.get(msg.request_id)
        if t is not None:
            self.owner.table.first_byte(t)
        bad = check_notice(msg, self.owner.layout, len(t.block_ids) if t is not None else self._cache_blocks)
        if bad is not None:  # its bytes cannot be received in step: the pair goes
            raise TransferError(f"bad layer notice from producer {self.address}: {bad}")
        if self.transport == "cuda_ipc":
            self._land(msg, None)
            return
        fits = t is not None and len(t.block_ids) >= msg.shape[1] \
            and list(msg.shape[2:]) == list(t.kv_caches[0].shape[2:]) and msg.shape[0] == 2 \
            and dtype_name(t.kv_caches[0].dtype) == msg.dtype
        run = block_run(t.block_ids[: msg.shape[1]]) if fits else None
        if msg.parts == 2 and run is not None and t.kv_caches[0].is_contiguous():  # (a head slice is not)
            kv = t.kv_caches[msg.layers[0]]
            buf, parts = None, [kv[0, run], kv[1, run]]
        else:
            self.staging.reverse()  # two buffers: one being received, one being scattered
            buf = self.staging[0].view(DTYPE_NAMES[msg.dtype], (len(msg.layers), *msg.shape))
            parts = [buf[0, 0], buf[0, 1]] if msg.parts == 2 else [buf]
        self._posted.append((msg, buf))
        assert self._waiter is not None
        pair, works, timeout_s = self.pair, self.pair.recv_async(parts), self.owner.config.timeout_s
        self._waiter.run(lambda: pair.wait(works, timeout_s), lambda error: self.run(self._received, pair, error))

    def _received(self, pair, error: BaseException | None) -> None:
        """The waiter's word on the oldest posted receive."""
        if pair is not self.pair:
            return  # a receive of a pair already torn down
        if error is not None:
            raise error
        msg, buf = self._posted.popleft()
        self._land(msg, buf)
        self._advance()

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

    # ---- tcp: in-band frames ---------------------------------------------------------------
    def _readable(self) -> None:
        assert self._reader is not None
        try:
            self._reader.feed()
        except PeerClosedError:
            if self.transfers or self._reader.mid_frame():
                raise
            logger.info("consumer: idle pair to %s closed; the next request builds a new one", self.address)
            self._close_pair()

    def _on_message(self, frame: Frame) -> None:
        try:
            msg = decode(frame.payload)
        except MessageError as e:
            raise TransferError(f"bad in-band message from {self.address}: {e}") from e
        if isinstance(msg, Done) and msg.pair_id == self.pair_id:
            self._finish(msg)

    def _on_kv(self, frame: Frame) -> tuple[list[memoryview], Callable[[], None] | None]:
        """Where a tcp KV message lands: straight into its request's blocks, or scratch when
        nobody waits for its bytes (aborted) or they do not fit (the request fails)."""
        t = self.transfers.get(frame.request_id)
        reason = ""
        if t is not None:
            self.owner.table.first_byte(t)
            bad_layer = not all(0 <= x < len(t.kv_caches) for x in frame.layers)
            if frame.num_blocks > len(t.block_ids) or bad_layer:
                reason = f"layers {list(frame.layers)}: {frame.num_blocks} blocks do not fit the request"
            elif kv_nbytes(t.kv_caches, frame.layers, frame.num_blocks) != frame.nbytes:
                reason = f"layers {list(frame.layers)}: {frame.nbytes} bytes do not fit"
        if t is None or reason:
            def dropped() -> None:
                self.owner.stats.add(bytes_received=frame.nbytes)
                if t is not None and self._take(t.request_id) is not None:
                    self.owner.failed(t, reason)
            return scratch_views(frame.nbytes), dropped
        ids = t.block_ids[: frame.num_blocks]
        views, scatter = kv_views(t.kv_caches, frame.layers, ids, self.staging[0])

        def landed() -> None:
            scatter()
            self.owner.stats.add(bytes_received=frame.nbytes)
            if self.transfers.get(t.request_id) is t:
                self._landed(t, frame.layers, frame.num_blocks, frame.nbytes)
        return views, landed

    # ---- landing -------------------------------------------------------------------------------
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
            # still ACKed: the producer holds the request's blocks until an ACK, and this pair's pings
            # renew that lease, so a transfer failed here (its deadline ran out on a slow link) would
            # keep them held for as long as the pair lives
            self._ack(msg.request_id)
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

    # ---- liveness ----------------------------------------------------------------------------
    def _heartbeat(self, now: float) -> None:
        cfg = self.owner.config
        if self._ping is not None and self._ping.done():
            fut, self._ping = self._ping, None
            if fut.exception() is not None:
                raise TransferError(f"producer {self.address} stopped answering: {fut.exception()}")
        if self._reader is not None and self._reader.mid_frame() and now - self._reader.last_byte > cfg.timeout_s:
            raise PairBrokenError(f"tcp transfer failed: no byte moved for {cfg.timeout_s:g} s")
        # lease + timeout with no layer landing (since the request or its latest layer: a slow link
        # that keeps moving is not cut off) means the producer is gone; a posted gloo/nccl receive
        # fails at its own deadline (its waiter), which drops the pair
        limit = cfg.lease_s + cfg.timeout_s
        posted = {entry[0].request_id for entry in self._posted}
        # tcp: bytes of a layer still arriving are progress too (on a lossy link one layer can take
        # longer than the limit, while the stall check above fails a frame that stopped moving)
        arriving = self._reader.request_id if self._reader is not None and self._reader.mid_frame() else None

        def progress(t: Transfer) -> float:
            since = t.last_landed or t.started
            return max(since, self._reader.last_byte) if t.request_id == arriving else since  # type: ignore[union-attr]
        late = [t for t in self.transfers.values() if now - progress(t) > limit and t.request_id not in posted]
        for t in late:
            self._fail_fenced(self._take(t.request_id), "timed out waiting for the producer")
        # a built pair is pinged even when idle: its control connection stays in use (the control
        # plane closes idle ones) and a producer that died meanwhile is noticed before the next request
        due = self._ping is None and now - self._last_ping >= cfg.heartbeat_s
        if due and (self.transfers or self.pair is not None):
            self._last_ping = now
            self._ping = self.owner.control.request(self.address, Ping(pair_id=self.pair_id), cfg.timeout_s)

    def _close_pair(self) -> None:
        if self._reader is not None:
            self._reader.closed = True
            self.owner.control.unwatch(self._fd)
            self._reader, self._fd = None, -1
        if self._waiter is not None:
            self._waiter.stop()
            self._waiter = None
        self._posted.clear()
        if self.pair is not None:
            self.pair.close()
        self.pair, self.pair_id, self.transport = None, "", ""
