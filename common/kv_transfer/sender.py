"""The producer's sender for one pair, run on the endpoint's I/O thread.

There is no thread per pair: jobs are put from any thread (the engine's ``save_layer`` and
``finish``, the I/O thread's PULL) and run in order on the I/O thread (control.py), which
never waits on the network:

- ``tcp`` sends straight from the blocks (the kernel gathers them) behind an in-band header,
  without blocking (tcp_pair.FrameWriter: what the socket does not take now goes when it is
  writable); the consumer's in-band PULLs and ACKs are read the same way (FrameReader);
- gloo/nccl keep two sends in flight, so layer i+1 is gathered while layer i is on the wire,
  and the next job's notice goes out before this job's bytes so the consumer can post its
  receive early. Contiguous block runs go in place; anything else is gathered into one of
  two reusable staging buffers, each after the engine's event for that KV (the I/O thread's
  stream waits on it, so the gather and NCCL's send come after the write). The pair's
  :class:`~common.kv_transfer.waiter.Waiter` thread waits for each send;
- ``cuda_ipc`` copies into the consumer's blocks on the pair's streams; DONE (and a fence's
  answer) goes once they finished, which the waiter waits for.

Building the pair (rank 0: waiting for the consumer to join) runs on a short-lived thread.
A cuda_ipc pair whose consumer stopped pinging it is closed (its mapping with it), and any
pair that carried no transfer for ``pair_idle_s`` is closed too (its sockets go; the
consumer builds a new one for its next request), so strangers' pairs do not pile up.
"""

from __future__ import annotations

import collections
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.kv_transfer.config import PairBrokenError, TransferConfig, TransferStats
from common.kv_transfer.cuda_ipc import IpcPair
from common.kv_transfer.messages import (Ack, Done, LayerNotice, Message, MessageError, Ok, Pull, decode,
                                         encode)
from common.kv_transfer.p2p_group import dtype_name
from common.kv_transfer.paged import ByteBudget, StagingBuffer, block_run, gather_blocks
from common.kv_transfer.streams import StreamOps, stream_ops
from common.kv_transfer.tcp_pair import Frame, FrameReader, FrameWriter, kv_message
from common.kv_transfer.transport import open_pair
from common.kv_transfer.verify import blocks_checksum
from common.kv_transfer.waiter import Waiter

if TYPE_CHECKING:
    from common.kv_transfer.control import ControlPlane
    from common.kv_transfer.producer import ProducerRequest
    from common.kv_transfer.producer_table import ProducerTable

logger = logging.getLogger(__name__)


class PairIdleError(PairBrokenError):
    """The pair carried no transfer for ``pair_idle_s``: closed like a broken one, logged as normal."""


@dataclass
class SendJob:
    """Send ``layers`` of ``req`` (gathered later unless ``staged``), or its DONE."""

    kind: str  # "layers" | "done" | "fence" (cuda_ipc abort: answer once the stream drained)
    req: ProducerRequest
    layers: list[int] = field(default_factory=list)
    staged: torch.Tensor | None = None  # [len(layers), 2, blocks, ...] gathered by save_layer
    source: tuple[torch.Tensor, list[int]] | None = None  # (kv layer, block ids) from save_layer, not staged
    ready: object | None = None  # event after this layer's KV write or gather (the send waits on it)
    reply_id: int = 0  # fence: the ABORT request to answer
    announced: bool = False  # its notice is out: the bytes must follow, dropped or not

    @property
    def budget(self) -> int:
        return self.staged.numel() * self.staged.element_size() if self.staged is not None else 0


STOP = None  # the job that ends a pair after the ones before it
QUICK_SYNC_S = 0.002  # cuda_ipc: copies this short are waited for on the I/O thread (``_sync``)


class PairSender:
    """One consumer's pair on the producer side. ``put``, ``drain``, ``heard`` and ``drop`` may
    be called from any thread; everything else runs on the I/O thread."""

    def __init__(self, pair_id: str, identity: bytes, *, config: TransferConfig, stats: TransferStats,
                 budget: ByteBudget, control: ControlPlane, device: str,
                 on_done_sent: Callable[[ProducerRequest], None],
                 on_failed: Callable[[PairSender, str], None],
                 on_message: Callable[[bytes, Message], None] | None = None,
                 streams: StreamOps | None = None,
                 in_use: Callable[[PairSender], bool] = lambda link: True,
                 table: ProducerTable) -> None:
        self.pair_id, self.identity = pair_id, identity
        self.config, self.stats, self._budget, self._control = config, stats, budget, control
        self.device = device
        self.streams = streams or stream_ops(device)
        self._on_done_sent, self._on_failed = on_done_sent, on_failed
        self._on_message = on_message  # the producer's handler, for what a tcp consumer sends in-band
        self.jobs: collections.deque = collections.deque()  # SendJob, or STOP; appended from any thread
        self.pair = None  # PairGroup | TcpPair | IpcPair, built on the builder thread
        self.transport = ""
        self.checksum = False  # DONE carries per-layer checksums (agreed at the handshake, verify.py)
        self.broken = False
        self.builder: threading.Thread | None = None  # waits for the consumer to join, then hands the pair over
        self._peer_cache: list | None = None  # cuda_ipc: handed to the pair, then held by it alone
        self._last_heard = time.monotonic()
        self._in_use = in_use  # does a live request still use this pair (the producer's table)
        self._table = table  # where this pair's checksums are recorded (a record's fields are its table's)
        self.last_used = time.monotonic()  # handshake or last PULL on this pair
        # keyless admission (producer.py): the consumer's KV address, and until when a pair whose
        # consumer is no registered decode node may keep its slot (None: a member's pair)
        self.consumer = ""
        self.probation_until: float | None = None
        self._rendezvous = None
        self._staging: list[StagingBuffer] = []
        self._inflight: collections.deque[tuple[list, int]] = collections.deque()  # gloo/nccl: (tensors, budget)
        self._waiter: Waiter | None = None  # gloo/nccl sends, cuda_ipc syncs
        self._syncing = False  # cuda_ipc: DONE or a fence waits for the copies to finish
        self._writer: FrameWriter | None = None  # tcp: the message going out
        self._after_write: Callable[[], None] | None = None
        self._reader: FrameReader | None = None  # tcp: the consumer's in-band PULLs and ACKs
        self._fd = -1
        self._next_tick = 0.0
        self.closed = False

    # ---- any thread ------------------------------------------------------------------------
    def start(self, rendezvous, transport: str, peer_cache: list | None = None) -> None:
        """Build the pair (rank 0: until the consumer joins) on the builder thread."""
        self.transport, self._peer_cache, self._rendezvous = transport, peer_cache, rendezvous
        self.builder = threading.Thread(target=self._build, name=f"kv-pair-{self.pair_id[:8]}", daemon=True)
        self.builder.start()

    def put(self, job: SendJob | None) -> None:
        """Queue a job (or STOP) for the I/O thread."""
        self.jobs.append(job)
        self._control.call_soon(self._pump)

    def heard(self) -> None:
        """The consumer spoke on this pair (a ping, a pull): it is still there."""
        self._last_heard = time.monotonic()

    def drop(self) -> None:
        """End the pair without waiting (its slot was given away): a tcp pair still waiting for its
        consumer stops waiting at once; a built one ends after its queued jobs; a gloo/NCCL one
        waiting on its store ends at its connect deadline."""
        if hasattr(self._rendezvous, "cancel"):
            self._rendezvous.cancel()
        self.put(STOP)

    def drain(self) -> None:
        """Release the staged bytes of jobs that will never run."""
        while True:
            try:
                job = self.jobs.popleft()
            except IndexError:
                return
            if job is not None:
                self._budget.release(job.budget)

    # ---- building ----------------------------------------------------------------------------
    def _build(self) -> None:
        # the mapped cache lives in the pair alone, so closing the pair unmaps it
        peer_cache, self._peer_cache = self._peer_cache, None
        try:
            pair = open_pair(self.transport, 0, self.config.timeout_s, self.pair_id,
                             connect_timeout_s=self.config.connect_timeout_s, rendezvous=self._rendezvous,
                             device=self.device, peer_cache=peer_cache, streams=self.streams,
                             key=self._control.key)
        except Exception as e:  # PairBrokenError (the consumer never came), or a bug
            error = e
            self._control.call_soon(lambda: self._fail(error))
            return
        finally:
            del peer_cache
        self._control.call_soon(lambda: self._built(pair))

    def _built(self, pair) -> None:
        if self.closed:
            pair.close()
            return
        self.pair = pair
        self._staging = [StagingBuffer(self.device), StagingBuffer(self.device)]
        if self.transport == "tcp":
            self._reader = FrameReader(pair, self._kv_from_consumer, self._read_message)
            self._fd = pair.fileno()
            self._control.watch(self._fd, self._readable)
        else:
            self._waiter = Waiter(f"send-{self.pair_id[:8]}", self._control.call_soon)
        self._pump()

    # ---- I/O thread ------------------------------------------------------------------------
    def _guard(self, step: Callable, *args) -> None:
        if self.closed:
            return
        try:
            step(*args)
        except Exception as e:  # PairBrokenError, or a bug: either way this pair is done
            self._fail(e)

    def _pump(self) -> None:
        """Run the queued jobs, in order, as far as they go without waiting."""
        self._guard(self._run_jobs)

    def _run_jobs(self) -> None:
        while self.pair is not None and self.jobs and self._writer is None and not self._syncing \
                and len(self._inflight) < 2:
            job = self.jobs.popleft()
            if job is STOP:
                if self._inflight:  # the sends in flight first
                    self.jobs.appendleft(job)
                    return
                self.close()
                return
            ahead = self.jobs[0] if self.jobs else None
            self._run_job(job, ahead)

    def tick(self, now: float) -> None:
        """Liveness and idleness, a few times a second (the producer's ``tick``)."""
        if self.closed or self.pair is None or now < self._next_tick:
            return
        self._next_tick = now + min(1.0, self.config.heartbeat_s) / 4
        self._guard(self._check_consumer, now)

    def _check_consumer(self, now: float) -> None:
        """cuda_ipc: nothing on the data plane tells that the consumer went (a restarted decode
        daemon just makes a new pair), and this pair maps its whole cache: its pings do. A tcp
        message that stopped moving for ``timeout_s`` means the consumer stopped reading."""
        silent = now - self._last_heard
        if self.transport == "cuda_ipc" and silent > self.config.peer_silent_s:
            raise PairBrokenError(f"consumer silent for {silent:.1f} s; dropping its pair and the mapping "
                                  "of its KV cache")
        if self._writer is not None and now - self._writer.last_progress() > self.config.timeout_s:
            raise PairBrokenError(f"tcp transfer failed: no byte moved for {self.config.timeout_s:g} s")
        if self._reader is not None and self._reader.mid_frame() \
                and now - self._reader.last_byte > self.config.timeout_s:
            raise PairBrokenError(f"tcp transfer failed: no byte moved for {self.config.timeout_s:g} s")
        idle = now - self.last_used
        if idle > self.config.pair_idle_s and not self.jobs and not self._in_use(self):
            raise PairIdleError(f"no transfer for {idle:.0f} s; closed (the consumer builds a new pair)")

    def _fail(self, e: BaseException) -> None:
        if self.closed:
            return
        log = logger.info if isinstance(e, PairIdleError) else logger.warning
        log("producer: pair %s %s: %s", self.pair_id[:8], "idle" if isinstance(e, PairIdleError) else "failed",
            e, exc_info=not isinstance(e, PairBrokenError))
        self.broken = True
        self.close()
        self._on_failed(self, str(e))

    def close(self) -> None:
        """Close the pair (its in-flight budgets go back); queued jobs stay for ``drain``."""
        if self.closed:
            return
        self.closed = self.broken = True
        for _, nbytes in self._inflight:
            self._budget.release(nbytes)
        self._inflight.clear()
        if self._fd >= 0:
            self._control.unwatch(self._fd)
            self._fd = -1
        if self._reader is not None:
            self._reader.closed = True
        self._writer = self._reader = None
        if self._waiter is not None:
            self._waiter.stop()
            self._waiter = None
        if self.pair is not None:  # off this thread: a cuda_ipc pair drains its streams first
            threading.Thread(target=self.pair.close, name=f"kv-close-{self.pair_id[:8]}", daemon=True).start()

    # ---- tcp: the consumer's in-band messages, and what goes out -------------------------------
    def _readable(self) -> None:
        if self._reader is not None:
            self._guard(self._reader.feed)

    def _kv_from_consumer(self, frame: Frame):
        raise PairBrokenError("the consumer sent KV bytes on its pair")

    def _read_message(self, frame: Frame) -> None:
        """tcp: a consumer's in-band message (PULL, ACK)."""
        try:
            msg = decode(frame.payload)
        except MessageError as e:
            raise PairBrokenError(f"bad in-band message from the consumer: {e}") from e
        if not isinstance(msg, Pull | Ack) or (isinstance(msg, Pull) and msg.pair_id != self.pair_id):
            raise PairBrokenError(f"unexpected in-band {msg.CMD} from the consumer")
        self._on_message(self.identity, msg)
        if not self.closed:
            self._run_jobs()  # what a PULL queued goes now, not after a turn of the I/O loop

    def _write(self, parts, then: Callable[[], None] | None = None) -> None:
        """Send ``parts`` (lists of byte views) on the tcp pair; ``then`` once all is out. What the
        socket does not take now goes when it is writable; jobs behind wait."""
        writer = FrameWriter(self.pair, parts)
        if writer.push():
            if then is not None:
                then()
            return
        self._writer, self._after_write = writer, then
        self._control.watch(self._fd, self._readable, self._writable)

    def _writable(self) -> None:
        self._guard(self._write_more)

    def _write_more(self) -> None:
        if self._writer is None or not self._writer.push():
            return
        then, self._writer, self._after_write = self._after_write, None, None
        self._control.watch(self._fd, self._readable)
        if then is not None:
            then()
        self._run_jobs()

    # ---- jobs --------------------------------------------------------------------------------
    def _run_job(self, job: SendJob, ahead: SendJob | None) -> None:
        """Announce (unless done already) and start one job."""
        req = job.req
        if job.kind == "fence":
            self._sync(lambda: self._control.reply(self.identity, Ok(id=job.reply_id)))
            return
        if req.dropped and (not job.announced or self.transport == "cuda_ipc"):
            self._budget.release(job.budget)
            return
        assert self.pair is not None
        if job.kind == "done":
            if not job.announced:
                self._send_done(job)
            return
        inband = self.transport == "tcp"  # the header travels with the bytes: nothing to announce
        if not job.announced and not inband:
            self._announce(job)
        if self.checksum and self.transport in ("gloo", "nccl"):  # before a DONE below may carry them
            self._after_kv_written(job)
            self._checksum_layers(job)
        if ahead is not None and not ahead.req.dropped and not ahead.announced:
            if ahead.kind == "layers" and not inband:
                self._announce(ahead)  # before gathering: the consumer posts both receives now
            elif ahead.kind == "done" and ahead.req is req and self.transport in ("gloo", "nccl"):
                # The consumer handles messages in order, so DONE may travel while the last
                # bytes do: it is read only after them (a failed send fails the pair anyway).
                self._send_done(ahead)
        if self.transport == "cuda_ipc":
            self.stats.add(bytes_sent=self.pair.write(job, self._source(job)))
            return
        if inband:
            self._send_tcp(job, ahead)
            return
        self._after_kv_written(job)
        staging = self._staging[0]
        self._staging.reverse()
        parts = self._parts(job, staging)
        try:
            work = self.pair.send_async(parts)
        except PairBrokenError:
            self._budget.release(job.budget)
            raise
        self.stats.add(bytes_sent=sum(p.numel() * p.element_size() for p in parts))
        self._inflight.append((parts, job.budget))  # the tensors outlive the send
        pair, waiter, timeout_s = self.pair, self._waiter, self.config.timeout_s
        assert waiter is not None
        waiter.run(lambda: pair.wait(work, timeout_s), lambda error: self._guard(self._sent, error))

    def _sent(self, error: BaseException | None) -> None:
        """The waiter's word on the oldest send in flight."""
        if error is not None:
            raise error
        _, nbytes = self._inflight.popleft()
        self._budget.release(nbytes)
        self._run_jobs()

    def _sync(self, then: Callable[[], None]) -> None:
        """cuda_ipc: ``then`` once every copy queued so far finished; jobs behind wait. Copies that
        end within :data:`QUICK_SYNC_S` are waited for here (a request's blocks: 262 MB take
        ~0.2 ms on an H200), sparing the two thread hand-offs of the waiter (~0.5 ms measured
        there, bench/kv_fixed_cost.py); longer ones are left to the waiter."""
        pair, waiter, timeout_s = self.pair, self._waiter, self.config.timeout_s
        assert waiter is not None and isinstance(pair, IpcPair)
        if pair.finished_within(QUICK_SYNC_S):
            then()
            return
        self._syncing = True

        def synced(error: BaseException | None) -> None:
            self._syncing = False
            if error is not None:
                raise error
            then()
            self._run_jobs()
        waiter.run(lambda: pair.synchronize(timeout_s), lambda error: self._guard(synced, error))

    def _checksum_layers(self, job: SendJob) -> None:
        """gloo/nccl with checksums: each layer's CRC-32 over its bytes in wire order (keys, then
        values, block by block), as the consumer computes it over the blocks it landed them in
        (a GPU tensor is copied to the host: an explicit ``--kv-checksum on`` costs that)."""
        if job.staged is not None:  # [layers, 2, blocks, ...]: each layer's blocks gathered already
            every = list(range(job.staged.shape[2]))
            self._checksummed(job.req, {layer: blocks_checksum(job.staged[j], every)
                                        for j, layer in enumerate(job.layers)})
            return
        kv_caches, ids = self._source(job)
        self._checksummed(job.req, {layer: blocks_checksum(kv_caches[layer], ids) for layer in job.layers})

    def _checksummed(self, req: ProducerRequest, checksums: dict[int, int]) -> None:
        self._table.checksummed(req, checksums)

    def _after_kv_written(self, job: SendJob) -> None:
        """gloo/nccl: order this thread's stream after the engine's event for the job's KV (its
        write, or save_layer's gather): the gather below and NCCL's send run after it."""
        ready = job.ready if job.ready is not None else job.req.ready
        if ready is not None:
            self.streams.wait(self.streams.current(torch.device(self.device)), ready)

    def _send_tcp(self, job: SendJob, ahead: SendJob | None) -> None:
        """tcp: the layers straight from the blocks behind their header; when the request's
        DONE is next in the queue, it rides in the same send right behind the last byte."""
        kv_caches, ids = self._source(job)
        assert job.staged is None, "save_layer stages nothing for a tcp pair"
        if self.checksum:  # before the trailer is built: a DONE riding with the last layer carries its CRC
            self._checksummed(job.req, {layer: blocks_checksum(kv_caches[layer], ids) for layer in job.layers})
        done = ahead if ahead is not None and ahead.kind == "done" and ahead.req is job.req \
            and not ahead.announced and not ahead.req.dropped else None
        trailer = self.pair.message_frame(encode(self._done(done.req))) if done is not None else b""
        nbytes, parts = kv_message(job.req.request_id, kv_caches, job.layers, ids, trailer)
        self.stats.add(bytes_sent=nbytes)
        if done is None:
            self._write(parts)
            return
        done.announced = True
        self._write(parts, lambda: self._on_done_sent(done.req))

    def _done(self, req: ProducerRequest) -> Done:
        kv = req.kv_caches[0] if req.kv_caches else None
        # from the shape, not the strides: the cache may be a slice of the heads (tp_slices)
        block_bytes = math.prod(kv.shape[2:]) * kv.element_size() * 2 if kv is not None else 0
        checksums = [req.checksums.get(x, 0) for x in range(len(req.kv_caches))] if self.checksum else []
        return Done(request_id=req.request_id, pair_id=self.pair_id, first_token=req.first_token,
                    first_logprobs=req.first_logprobs, choices=req.choices, cached_tokens=req.cached_tokens,
                    nonce=req.nonce, num_layers=len(req.kv_caches),
                    nbytes=block_bytes * req.num_blocks * len(req.kv_caches), checksums=checksums)

    def _send_done(self, job: SendJob) -> None:
        job.announced = True
        if self.transport == "cuda_ipc":  # every copy landed before DONE says so
            self._sync(lambda: self._done_out(job))
        else:
            self._done_out(job)

    def _done_out(self, job: SendJob) -> None:
        if self.transport == "tcp":  # behind the request's last bytes, on the same stream
            frame = self.pair.message_frame(encode(self._done(job.req)))
            self._write([[memoryview(frame)]], lambda: self._on_done_sent(job.req))
            return
        self._control.reply(self.identity, self._done(job.req))
        self._on_done_sent(job.req)

    def _announce(self, job: SendJob) -> None:
        req = job.req
        if job.staged is not None:  # staged during prefill: block_ids are not known yet
            kv, shape, parts = job.staged, list(job.staged.shape[1:]), 1
        else:
            kv_caches, ids = self._source(job)
            kv = kv_caches[job.layers[0]]
            shape = [2, len(ids), *kv.shape[2:]]
            gloo_run = self.transport in ("gloo", "nccl") and len(job.layers) == 1 and block_run(ids) \
                and kv.is_contiguous()
            parts = 2 if gloo_run else 1
        self._control.reply(self.identity, LayerNotice(request_id=req.request_id, pair_id=self.pair_id,
                                                      layers=job.layers, dtype=dtype_name(kv.dtype),
                                                      shape=shape, parts=parts))
        job.announced = True

    @staticmethod
    def _source(job: SendJob) -> tuple[dict[int, torch.Tensor] | list[torch.Tensor], list[int]]:
        """(layer -> KV tensor, block ids) the job reads from."""
        if job.source is not None:
            return {job.layers[0]: job.source[0]}, job.source[1]
        return job.req.kv_caches, job.req.block_ids[: job.req.num_blocks]

    def _parts(self, job: SendJob, staging: StagingBuffer) -> list[torch.Tensor | memoryview]:
        """The tensor(s) to put on the wire, matching what :meth:`_announce` said."""
        if job.staged is not None:
            return [job.staged]
        kv_caches, ids = self._source(job)
        run = block_run(ids)
        if run is not None and len(job.layers) == 1 and kv_caches[job.layers[0]].is_contiguous():
            kv = kv_caches[job.layers[0]]  # keys and values of a run are contiguous: no gather
            return [kv[0, run], kv[1, run]]
        kv0 = kv_caches[job.layers[0]]
        out = staging.view(kv0.dtype, (len(job.layers), 2, len(ids), *kv0.shape[2:]))
        for j, layer in enumerate(job.layers):
            gather_blocks(kv_caches[layer], ids, out[j])
        return [out]
