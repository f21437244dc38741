"""The ``cuda_ipc`` data plane: the producer writes straight into the consumer's KV blocks.

Both KV caches are on CUDA and able to share memory (one shared GPU, or two GPUs of one
host, both visible to the producer). Once per pair the consumer exports its cache's CUDA
IPC handles in the handshake (:func:`export_cache`); the producer opens them
(:func:`open_cache`, on the control thread, so a cache it cannot map refuses the handshake
with the fix). For each job the producer's I/O thread copies the request's blocks into
the consumer's blocks, ordered after the layer's KV write by the event the engine thread
recorded (``SendJob.ready``). The copies run on the pair's streams: one on the producer's
device, and one on the destination device, where each copy ends (``index_copy_`` runs
there; torch orders it after a cross-device copy). DONE goes out only once an event
recorded on that destination stream completed (streams.py has the rules).
Nothing is received on the consumer: layer notices just count the layers.

An abort, a failed link, or any transfer the consumer gives up on, must not let a copy
land in blocks the consumer is about to reuse: the consumer waits for the producer's answer
to ABORT, which the sender gives after its streams drained (``KVProducer._on_abort``), or
for that answer's deadline (a producer that does not answer in time is taken for dead).

The mapping of the consumer's cache lives as long as the pair: closing the pair drains its
streams, drops the mapped tensors and lets CUDA IPC release them, so a decode daemon that
restarted gets its memory back once the producer drops the old pair (it does when that
consumer stops pinging it, see ``TransferConfig.peer_silent_s``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor

from common.kv_layout import block_major
from common.kv_transfer.config import PairBrokenError
from common.kv_transfer.p2p_group import DTYPE_NAMES, dtype_name
from common.kv_transfer.paged import block_run
from common.kv_transfer.streams import StreamOps

if TYPE_CHECKING:
    from common.kv_transfer.sender import SendJob


def export_cache(kv_caches: list[torch.Tensor]) -> list[dict]:
    """Each layer's IPC handle and geometry, as plain msgpack-able values."""
    out = []
    for t in kv_caches:
        args = reduce_tensor(t)[1]
        (_, size, stride, offset, _, _, _, handle, storage_bytes, storage_offset, _, ref_handle, ref_offset,
         event_handle, event_sync) = args
        out.append({"gpu_uuid": str(torch.cuda.get_device_properties(t.device).uuid), "shape": list(size),
                    "stride": list(stride), "offset": offset, "dtype": dtype_name(t.dtype), "handle": handle,
                    "storage_bytes": storage_bytes, "storage_offset": storage_offset,
                    "ref_handle": ref_handle, "ref_offset": ref_offset, "event_handle": event_handle,
                    "event_sync": bool(event_sync)})
    return out


def _local_index(gpu_uuid: str) -> int:
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == gpu_uuid:
            return i
    raise RuntimeError(f"GPU {gpu_uuid} is not visible to this process (CUDA_VISIBLE_DEVICES)")


def open_cache(exported: list[dict]) -> list[torch.Tensor]:
    """The consumer's KV cache tensors, mapped into this process."""
    out = []
    for e in exported:
        out.append(rebuild_cuda_tensor(
            torch.Tensor, torch.Size(e["shape"]), tuple(e["stride"]), e["offset"], torch.TypedStorage,
            DTYPE_NAMES[e["dtype"]], _local_index(e["gpu_uuid"]), e["handle"], e["storage_bytes"],
            e["storage_offset"], False, e["ref_handle"], e["ref_offset"], e["event_handle"], e["event_sync"]))
    return out


class BlockCopy:
    """``dst[:, dst_ids] = src[:, src_ids]`` for each layer of a job (or ``dst[dst_ids] =
    src[src_ids]`` over two pools' block-major views: every layer at once), on the current streams
    of both devices (the last kernel runs on ``dst``'s); runs copy without a gather. The index
    tensors are made once per job, not once per layer (each is a host-to-device copy that waits).
    Make it inside the streams the copies run on: the index copies are queued there."""

    def __init__(self, dst_ids: list[int], src_ids: list[int], src_device: torch.device,
                 dst_device: torch.device) -> None:
        self.drun, self.srun = block_run(dst_ids), block_run(src_ids)
        both_runs = self.drun is not None and self.srun is not None
        self.src_index = None if self.srun is not None else torch.tensor(src_ids, device=src_device)
        self.dst_index = None if both_runs else torch.tensor(dst_ids, device=dst_device)

    def __call__(self, dst: torch.Tensor, src: torch.Tensor, dim: int = 1) -> None:
        """Along ``dim``, the blocks' axis: 1 in a layer's ``[2, blocks, ...]``, 0 in a block-major view."""
        at = (slice(None),) * dim
        if self.dst_index is None:
            dst[(*at, self.drun)].copy_(src[(*at, self.srun)], non_blocking=True)
            return
        gathered = src[(*at, self.srun)] if self.src_index is None else src.index_select(dim, self.src_index)
        dst.index_copy_(dim, self.dst_index, gathered.to(dst.device, non_blocking=True))


class IpcPair:
    """Rank 0 holds the consumer's mapped cache and the transfer streams; rank 1 holds nothing."""

    backend = "cuda_ipc"

    def __init__(self, rank: int, device: str, peer_cache: list[torch.Tensor] | None, timeout_s: float,
                 streams: StreamOps) -> None:
        self.rank, self.broken, self.timeout_s, self.streams = rank, False, timeout_s, streams
        self.peer_cache = peer_cache or []
        # both pools block by block (kv_layout.block_major), for a job of every layer: one copy
        self._peer_major = block_major(self.peer_cache) if self.peer_cache else None
        self._own: tuple[object, torch.Tensor | None] | None = None  # (the producer's cache list, its view)
        self.src_stream = self.dst_stream = None
        if rank == 0:
            here = torch.device(device)
            there = self.peer_cache[0].device if self.peer_cache else here
            self.src_stream = streams.new_stream(here)
            self.dst_stream = self.src_stream if there == here else streams.new_stream(there)

    def write(self, job: SendJob, source: tuple) -> int:
        """Queue the copies of ``job``'s layers into the consumer's blocks; returns their bytes."""
        assert self.src_stream is not None
        kv_src, src_ids = source
        dst_ids = job.req.remote_block_ids[: len(src_ids)]
        if len(dst_ids) < len(src_ids):
            raise PairBrokenError(f"consumer named {len(dst_ids)} blocks, producer sends {len(src_ids)}")
        ready = job.ready if job.ready is not None else job.req.ready
        nbytes = 0
        with self.streams.use(self.src_stream, self.dst_stream):
            if ready is not None:
                self.streams.wait(self.src_stream, ready)  # after the layer's KV write on the compute stream
            whole = self._whole_pools(job, kv_src)
            if whole is not None:  # every layer of the pool in one copy (a gather and a scatter at most)
                dst, src = whole
                BlockCopy(dst_ids, src_ids, src.device, dst.device)(dst, src, dim=0)
                return len(src_ids) * src[0].numel() * src.element_size()
            copy = None
            for j, layer in enumerate(job.layers):
                src = job.staged[j] if job.staged is not None else kv_src[layer]
                ids = list(range(src.shape[1])) if job.staged is not None else src_ids
                if copy is None:  # the same blocks in every layer of the job
                    copy = BlockCopy(dst_ids[:len(ids)], ids, src.device, self.peer_cache[layer].device)
                copy(self.peer_cache[layer], src)
                nbytes += len(ids) * src[:, :1].numel() * src.element_size()
        return nbytes

    def _whole_pools(self, job: SendJob, kv_src: object) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(consumer's, producer's) block-major views when ``job`` copies every layer of the pool
        from its blocks (not staged) and both pools are one allocation each; else None."""
        if self._peer_major is None or job.staged is not None or not isinstance(kv_src, list) \
                or job.layers != list(range(len(kv_src))) or len(kv_src) != len(self.peer_cache):
            return None
        if self._own is None or self._own[0] is not kv_src:
            self._own = (kv_src, block_major(kv_src))
        src = self._own[1]
        return None if src is None else (self._peer_major, src)

    def finished_within(self, seconds: float) -> bool:
        """Whether every queued copy finished within ``seconds`` (a short wait on the calling
        thread; False says nothing is wrong, only that :meth:`synchronize` must wait on)."""
        if self.dst_stream is None:
            return True
        return self.streams.synchronize(self.streams.record(self.dst_stream), seconds)

    def synchronize(self, timeout_s: float) -> None:
        """Wait until every queued copy finished, at most ``timeout_s``: an event on the
        destination stream, where every copy ends."""
        if self.dst_stream is None:
            return
        if not self.streams.synchronize(self.streams.record(self.dst_stream), timeout_s):
            self.broken = True
            raise PairBrokenError("cuda_ipc copies did not finish before the deadline")

    def close(self) -> None:
        """Drain the streams, then drop the mapping of the consumer's cache."""
        if self.peer_cache and self.dst_stream is not None:
            try:
                self.synchronize(self.timeout_s)  # no copy may still target memory we unmap
            except PairBrokenError:
                pass  # unmapped anyway: holding a gone consumer's whole cache is worse
        self.broken = True
        had_mapping, self.peer_cache = bool(self.peer_cache), []
        self._peer_major = self._own = None  # a view of the mapping holds it too
        if had_mapping:
            self.streams.release_ipc()
