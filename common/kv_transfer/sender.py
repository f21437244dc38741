"""The producer's sender for one pair: a job queue drained by one thread.

Two sends are kept in flight, so layer i+1 is gathered while layer i is on the wire, and
the next job's notice goes out before this job's bytes so the consumer can post its
receive early. Contiguous block runs are sent in place; anything else is gathered into
one of two reusable staging buffers.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.kv_transfer.config import PairBrokenError, TransferConfig, TransferStats
from common.kv_transfer.messages import Done, LayerNotice
from common.kv_transfer.p2p_group import PairGroup, dtype_name
from common.kv_transfer.paged import ByteBudget, StagingBuffer, block_run, gather_blocks

if TYPE_CHECKING:
    from common.kv_transfer.control import ControlPlane
    from common.kv_transfer.producer import ProducerRequest

logger = logging.getLogger(__name__)


@dataclass
class SendJob:
    """Send ``layers`` of ``req`` (gathered later unless ``staged``), or its DONE."""

    kind: str  # "layers" | "done"
    req: ProducerRequest
    layers: list[int] = field(default_factory=list)
    staged: torch.Tensor | None = None  # [len(layers), 2, blocks, ...] gathered by save_layer
    announced: bool = False  # its notice is out: the bytes must follow, dropped or not

    @property
    def budget(self) -> int:
        return self.staged.numel() * self.staged.element_size() if self.staged is not None else 0


class _Sends:
    """A layer's send handles plus the tensors they read from (must outlive the sends)."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        self.works, self.tensors = works, tensors

    def wait(self, timeout) -> None:
        for work in self.works:
            work.wait(timeout)


class PairSender:
    """One consumer's pair on the producer side and the thread that feeds it."""

    def __init__(self, pair_id: str, identity: bytes, *, config: TransferConfig, stats: TransferStats,
                 budget: ByteBudget, control: ControlPlane, device: str,
                 on_done_sent: Callable[[ProducerRequest], None], on_failed: Callable[[PairSender, str], None]) -> None:
        self.pair_id, self.identity = pair_id, identity
        self.config, self.stats, self._budget, self._control, self.device = config, stats, budget, control, device
        self._on_done_sent, self._on_failed = on_done_sent, on_failed
        self.jobs: queue.SimpleQueue[SendJob | None] = queue.SimpleQueue()
        self.pair: PairGroup | None = None
        self.broken = False
        self.thread: threading.Thread | None = None

    def start(self, store, backend: str) -> None:
        """Build the pair (rank 0, blocks until the consumer joins) and serve jobs, off-thread."""
        self.thread = threading.Thread(target=self._run, args=(store, backend),
                                       name=f"kv-send-{self.pair_id[:8]}", daemon=True)
        self.thread.start()

    def stop(self, timeout_s: float) -> None:
        self.jobs.put(None)
        if self.thread is not None:
            self.thread.join(timeout_s)

    def drain(self) -> None:
        """Release the staged bytes of jobs that will never run."""
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._budget.release(job.budget)

    def _run(self, store, backend: str) -> None:
        # Two sends in flight: layer i+1 is gathered and announced while layer i is on the
        # wire. The next job's notice goes out before this job's bytes, so the consumer can
        # post its receive early. Gathered layers alternate between two staging buffers.
        staging = [StagingBuffer(self.device), StagingBuffer(self.device)]
        inflight: collections.deque[tuple[_Sends, int]] = collections.deque()
        ahead: SendJob | None = None
        try:
            self.pair = PairGroup(backend, 0, store.host, store.port, self.config.handshake_timeout_s, store=store,
                                  device=self.device)
            while True:
                if ahead is not None:
                    job, ahead = ahead, None
                else:
                    try:
                        job = self.jobs.get(block=not inflight)
                    except queue.Empty:
                        self._retire(inflight)  # nothing new: let the oldest send finish
                        continue
                if job is None:
                    while inflight:
                        self._retire(inflight)
                    break
                if len(inflight) >= 2:
                    self._retire(inflight)
                try:
                    ahead = self.jobs.get_nowait()
                except queue.Empty:
                    pass
                sent = self._run_job(job, staging[0], ahead)
                if sent is not None:
                    inflight.append(sent)
                    staging.reverse()
        except Exception as e:  # PairBrokenError, or a bug: either way this pair is done
            logger.warning("producer: pair %s failed: %s", self.pair_id, e, exc_info=not isinstance(e, PairBrokenError))
            for _, nbytes in inflight:
                self._budget.release(nbytes)
            if ahead is not None:
                self._budget.release(ahead.budget)
            self.broken = True
            self._on_failed(self, str(e))
        finally:
            if self.pair is not None:
                self.pair.close()

    def _retire(self, inflight: collections.deque) -> None:
        work, nbytes = inflight[0]
        self.pair.wait(work, self.config.timeout_s)
        inflight.popleft()
        self._budget.release(nbytes)

    def _run_job(self, job: SendJob, staging: StagingBuffer, ahead: SendJob | None) -> tuple | None:
        """Announce (unless done already) and post one job; returns (sends, budget bytes)."""
        req = job.req
        if req.dropped and not job.announced:
            self._budget.release(job.budget)
            return None
        assert self.pair is not None
        if job.kind == "done":
            self._control.reply(self.identity, Done(request_id=req.request_id, pair_id=self.pair_id,
                                                    first_token=req.first_token))
            self._on_done_sent(req)
            return None
        if not job.announced:
            self._announce(job)
        if ahead is not None and ahead.kind == "layers" and not ahead.req.dropped and not ahead.announced:
            self._announce(ahead)  # before gathering: the consumer posts both receives now
        parts = self._parts(job, staging)
        try:
            works = [self.pair.send_async(part) for part in parts]
        except PairBrokenError:
            self._budget.release(job.budget)
            raise
        self.stats.add(bytes_sent=sum(p.numel() * p.element_size() for p in parts))
        return (_Sends(works, parts), job.budget)

    def _announce(self, job: SendJob) -> None:
        req = job.req
        if job.staged is not None:  # staged during prefill: block_ids are not known yet
            kv, shape, parts = job.staged, list(job.staged.shape[1:]), 1
        else:
            ids = req.block_ids[: req.num_blocks]
            kv = req.kv_caches[job.layers[0]]
            shape = [2, len(ids), *kv.shape[2:]]
            parts = 2 if len(job.layers) == 1 and block_run(ids) else 1
        self._control.reply(self.identity, LayerNotice(request_id=req.request_id, pair_id=self.pair_id,
                                                      layers=job.layers, dtype=dtype_name(kv.dtype),
                                                      shape=shape, parts=parts))
        job.announced = True

    def _parts(self, job: SendJob, staging: StagingBuffer) -> list[torch.Tensor]:
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
