"""CUDA graphs for decode-only steps: captured once at start, replayed with one metadata copy.

A decode step launches ~10 kernels per layer; on a GPU their launch cost, not the GPU, bounds
the step. So the forward of a decode-only step (one query token per sequence) is captured as a
CUDA graph for each batch-size bucket up to ``max_num_seqs`` and replayed. Graphs read fixed
addresses, so every input lives in ``DecodeBuffers``: one device int32 buffer, laid out as
``ids | positions | slots | seq_lens`` (``max_batch`` each) then the block tables
(``max_batch x max_blocks_per_seq``), so a step's rows are one contiguous prefix, filled on the
host (pinned) and copied with one ``copy_``. A step of ``n`` sequences runs in the smallest
bucket ``b >= n``; rows ``n..b-1`` are padding: token 0 at position 0 whose K/V go to the
cache's scratch block (never handed out by the block manager), attending to that one slot, so
padding never touches a real sequence's KV.

The graphs' memory is measured as what this process's caching allocator reserved while they
were captured (``memory_reserved``, which counts the graphs' private pool), not as the drop in
the device's free memory: ``pdserve up`` starts two daemons on one GPU at once, and the other
daemon's allocations in the meantime are not this process's graphs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from common.engine.config import EngineConfig
from common.kv_layout import KVLayout
from common.model.attention import choose_kernels, use_kernels
from common.model.attention_metadata import AttentionMetadata

log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets: 1, 2, 4, 8, then every multiple of 8, and ``max_num_seqs`` itself."""
    sizes = {b for b in (1, 2, 4) if b <= max_num_seqs}
    sizes |= set(range(8, max_num_seqs + 1, 8)) | {max_num_seqs}
    return sorted(sizes)


def reserved_during(run: Callable[[], object], reserved: Callable[[], int],
                    sync: Callable[[], None] = lambda: None) -> int:
    """Bytes ``reserved`` (this process's allocator) grew by while ``run`` ran, its work finished.

    Only this process's own bytes count: another process's allocations in the meantime do not."""
    sync()
    before = reserved()
    run()
    sync()
    return max(0, reserved() - before)


def choose_bucket(n: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds ``n`` rows; None when ``n`` is past the largest."""
    for b in sizes:
        if b >= n:
            return b
    return None


class DecodeBuffers:
    """The persistent, padded inputs of a decode-only step (see the module docstring)."""

    def __init__(self, max_batch: int, max_blocks_per_seq: int, block_size: int, scratch_block: int,
                 device: torch.device) -> None:
        self.max_batch, self.width = max_batch, max_blocks_per_seq
        self.block_size, self.scratch_block = block_size, scratch_block
        size = 4 * max_batch + max_batch * max_blocks_per_seq
        self.host = torch.zeros(size, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._host_np = self.host.numpy()
        self.device_buf = torch.zeros(size, dtype=torch.int32, device=device)
        b = max_batch
        self.input_ids, self.positions = self.device_buf[:b], self.device_buf[b : 2 * b]
        self.slots, self.seq_lens = self.device_buf[2 * b : 3 * b], self.device_buf[3 * b : 4 * b]
        self.block_tables = self.device_buf[4 * b :].view(b, max_blocks_per_seq)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=device)  # one query per row
        self.host_seq_lens: list[int] = [1] * b
        # the host buffer is rewritten each step: wait until the previous step's copy has read it
        self._copied = torch.cuda.Event() if device.type == "cuda" else None

    def fill(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
             block_tables: list[list[int]], bucket: int) -> None:
        """Write ``n`` real rows and ``bucket - n`` padding rows, then copy them to the device at once."""
        n, b, h = len(input_ids), self.max_batch, self._host_np
        if not n <= bucket <= b:
            raise ValueError(f"{n} rows do not fit bucket {bucket} (max {b})")
        pad = bucket - n
        if self._copied is not None:
            self._copied.synchronize()
        scratch_slot = self.scratch_block * self.block_size
        h[:n], h[n:bucket] = input_ids, 0
        h[b : b + n], h[b + n : b + bucket] = positions, 0
        h[2 * b : 2 * b + n], h[2 * b + n : 2 * b + bucket] = slots, scratch_slot
        h[3 * b : 3 * b + n], h[3 * b + n : 3 * b + bucket] = seq_lens, 1
        tables = h[4 * b :].reshape(b, self.width)
        for i, row in enumerate(block_tables):
            row = row[: self.width]  # blocks allocated ahead past max_model_len are never read
            tables[i, : len(row)] = row
        tables[n:bucket, 0] = self.scratch_block
        self.host_seq_lens[:bucket] = list(seq_lens) + [1] * pad
        end = 4 * b + bucket * self.width  # the used prefix: all per-row fields, then `bucket` table rows
        self.device_buf[:end].copy_(self.host[:end], non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def fill_padding(self, bucket: int) -> None:
        """All rows padding: what a graph is captured with."""
        self.fill([], [], [], [], [], bucket)

    def inputs(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Input ids, positions and attention metadata of the first ``bucket`` rows (views of the buffer)."""
        meta = AttentionMetadata(
            slot_mapping=self.slots[:bucket], query_lens=[1] * bucket, seq_lens=self.host_seq_lens[:bucket],
            block_tables=self.block_tables[:bucket], block_size=self.block_size,
            query_start_loc=self.query_start_loc[: bucket + 1], seq_lens_tensor=self.seq_lens[:bucket],
        )
        return self.input_ids[:bucket], self.positions[:bucket], meta


class CudaGraphRunner:
    """One captured decode forward per bucket, all in one memory pool, replayed by ``run``."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], buffers: DecodeBuffers,
                 sizes: Sequence[int]) -> None:
        self.model, self.kv_caches, self.buffers = model, kv_caches, buffers
        self.sizes = sorted(sizes)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def capture(self) -> int:
        """Capture every bucket, largest first (the smaller ones reuse its pool); returns the bytes this
        process's allocator reserved for them (see the module docstring)."""
        device = self.buffers.device_buf.device
        return reserved_during(self._capture_all, lambda: torch.cuda.memory_reserved(device),
                               lambda: torch.cuda.synchronize(device))

    def _capture_all(self) -> None:
        device = self.buffers.device_buf.device
        pool = None
        for b in reversed(self.sizes):
            self.buffers.fill_padding(b)
            ids, positions, meta = self.buffers.inputs(b)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # warm up off the capture: compiles kernels, sets up cuBLAS
                self.model(ids, positions, self.kv_caches, meta)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a KV-transfer thread's CUDA calls must not invalidate this capture
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self.model(ids, positions, self.kv_caches, meta)
            pool = graph.pool()
            self._graphs[b] = (graph, out)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Replay the bucket for these ``n`` decode rows: hidden states [n, hidden] until the next run."""
        n = len(input_ids)
        bucket = choose_bucket(n, self.sizes)
        if bucket is None:
            raise ValueError(f"{n} sequences exceed the largest captured batch {self.max_batch_size}")
        self.buffers.fill(input_ids, positions, slots, seq_lens, block_tables, bucket)
        return self.replay(bucket)[:n]

    def replay(self, bucket: int) -> torch.Tensor:
        """Run the captured forward of ``bucket`` over the buffers as they are; its hidden states."""
        graph, out = self._graphs[bucket]
        graph.replay()
        return out


def graph_memory(model: torch.nn.Module, kv_layout: KVLayout, config: EngineConfig, max_positions: int) -> int:
    """Bytes the decode graphs ``config`` asks for will take (0 for none), to set aside before the
    KV cache is sized: learnt by capturing the largest bucket against a 2-block cache (the KV cache
    is an input, not part of the graphs' pool)."""
    device = config.resolved_device()
    kernels = choose_kernels(config.attention_backend, config.fused_ops, device, config.batch_invariant)
    use_kernels(model, kernels, device)
    if device.type != "cuda" or config.enforce_eager or not model.attn_backend.supports_cuda_graphs:
        return 0
    max_num_seqs = config.max_num_seqs
    max_blocks_per_seq = -(-(config.max_model_len or max_positions) // config.block_size)
    caches = [torch.zeros(kv_layout.layer_shape(2), dtype=kv_layout.torch_dtype, device=device)
              for _ in range(kv_layout.num_layers)]
    buffers = DecodeBuffers(max_num_seqs, 1, kv_layout.block_size, 1, device)
    graphs = CudaGraphRunner(model, caches, buffers, [max_num_seqs])
    try:
        with torch.inference_mode():
            used = graphs.capture()
    except Exception:
        log.warning("CUDA graph trial capture failed; decode steps will run eagerly", exc_info=True)
        return 0
    finally:
        del graphs, caches, buffers
        torch.cuda.empty_cache()
    return used + 4 * max_num_seqs * max_blocks_per_seq  # plus the real block-table buffer
