"""Runs one scheduled batch through the model: flat tensors in, sampled tokens out.

The batch is flat (vLLM's layout): the new tokens of every scheduled sequence are
concatenated. Only sequences whose every token is computed after this step (a finished
prompt, a decode) are sampled; a prefill chunk that stops mid-prompt is not.

The step's metadata (ids, positions, slots, block tables, sequence lengths) is built once on
the host and reaches the device in one copy; every layer shares it. A decode-only step on
CUDA replays a captured graph instead (``cuda_graph``), unless ``enforce_eager``.

Under tensor parallelism (``parallel``) the runner of rank 0 broadcasts each step's packed
inputs (and block copies) to the workers before it runs them; a worker's runner replays them
(``follow_step``). Each rank's cache holds only its KV heads; decode steps run eagerly.

At start the runner warms its kernels up (on CUDA, and wherever Triton runs): Triton compiles
each kernel on first launch, so a machine without a C compiler or the Python headers fails
here, not under the first request. Then the runner falls back to SDPA and the PyTorch ops with
a warning, or stops with :class:`TritonStartError` when a flag asked for Triton by name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch

from common.engine.choices import FirstToken, expand_rows, split_choices
from common.engine.cuda_graph import CudaGraphRunner, DecodeBuffers, graph_batch_sizes
from common.engine.parallel import COPY, INIT, STEP, Leader
from common.engine.sampler import Sampler, SampleRow
from common.engine.scheduler import ScheduledBatch
from common.engine.sequence import Sequence
from common.kv_layout import KVLayout
from common.model.attention import TRITON_HINT, KernelChoice, use_kernels, warm_up_fallback
from common.model.attention_metadata import AttentionMetadata
from common.model.batch_invariant import ProductLinear, warm_packed_linears

log = logging.getLogger(__name__)


@dataclass
class HostInputs:
    """One step's metadata as host lists, before it goes to the device."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    sampled_seqs: list[Sequence]


@dataclass
class ModelInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    sample_rows: torch.Tensor  # flat index of the last token of each sampled sequence
    sampled_seqs: list[Sequence]


@dataclass
class RunnerOutput:
    sampled_seqs: list[Sequence]
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]
    # n > 1: a sequence that sampled its first token -> choices 1..'s first tokens (same logits)
    choice_firsts: dict[Sequence, list[FirstToken]] = field(default_factory=dict)


LayerHook = Callable[[int, torch.Tensor], None]  # (layer index, that layer's KV cache) after it wrote


class ModelRunner:
    """Owns the model, the KV cache tensors (one per layer), the attention backend and the sampler.

    Each layer's cache has one block past ``num_blocks``: the scratch block padding rows of a
    CUDA-graph step write to (the block manager only hands out ``0..num_blocks-1``).
    """

    def __init__(
        self, model: torch.nn.Module, kv_layout: KVLayout, num_blocks: int, device: torch.device, seed: int,
        kernels: KernelChoice, enforce_eager: bool = False, max_num_seqs: int = 64,
        max_model_len: int | None = None, eos_token_ids: Iterable[int] = (), max_num_batched_tokens: int = 0,
    ):
        self.model = model
        self.device = device
        tp = model.tp
        self.leader = tp.comm if isinstance(tp.comm, Leader) else None  # rank 0 of several
        if self.leader is not None:
            self.leader.send(INIT, [num_blocks, kv_layout.block_size])
        if tp.size > 1:  # this rank's KV heads only
            kv_layout = replace(kv_layout, num_kv_heads=model.model.layers[0].self_attn.num_kv_heads)
            enforce_eager = True  # no collectives inside captured graphs (yet)
        self.kv_layout = kv_layout
        self._use(kernels)
        self.scratch_block = num_blocks
        # every layer's cache a slice of one allocation: the KV tiers gather and scatter any blocks of
        # all layers in one kernel (kv_tiers.block_major)
        self.kv_caches = list(torch.zeros((kv_layout.num_layers, *kv_layout.layer_shape(num_blocks + 1)),
                                          dtype=kv_layout.torch_dtype, device=device).unbind(0))
        self.sampler = Sampler(device, seed, eos_token_ids)
        self.graphs: CudaGraphRunner | None = None
        self.graph_memory_bytes = 0
        if device.type == "cuda" or kernels.uses_triton:
            self._warm_up_or_fall_back()
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.warmed_kernels = 0  # oneDNN kernels built by warm_up_kernels
        if device.type == "cuda" and not enforce_eager and self.attn_backend.supports_cuda_graphs:
            max_len = max_model_len or num_blocks * kv_layout.block_size
            self._capture_graphs(max_num_seqs, -(-max_len // kv_layout.block_size))

    def _use(self, kernels: KernelChoice) -> None:
        self.kernels = kernels
        use_kernels(self.model, kernels, self.device)
        self.attn_backend = self.model.attn_backend

    def _warm_up_or_fall_back(self) -> None:
        try:
            self._warm_up()
        except Exception as exc:
            failed = self.kernels
            self._use(warm_up_fallback(failed, exc))  # raises when Triton was named or not in use
            log.warning(
                "Triton kernels failed at warm-up (%s: %s); running %s attention and PyTorch's ops instead "
                "(was %s, fused ops %s). %s; or pass --attention-backend sdpa --fused-ops off to run "
                "without Triton and this warning", type(exc).__name__, exc, self.kernels.attention_backend,
                failed.attention_backend, "on" if failed.fused_ops else "off", TRITON_HINT)
            self._warm_up()

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """A 2-token prompt and one decode step into the scratch block, so that kernels compiled on
        first launch (Triton's) are ready before the first request rather than during it."""
        bs, d = self.kv_layout.block_size, self.device
        first = min(2, bs)
        for start, q in [(0, first)] + ([(first, 1)] if bs > first else []):
            positions = list(range(start, start + q))
            meta = AttentionMetadata(
                slot_mapping=torch.tensor([self.scratch_block * bs + p for p in positions], device=d),
                query_lens=[q], seq_lens=[start + q], block_size=bs,
                block_tables=torch.tensor([[self.scratch_block]], device=d),
            )
            ids = torch.zeros(q, dtype=torch.int64, device=d)
            self.model(ids, torch.tensor(positions, device=d), self.kv_caches, meta)

    def warm_up_kernels(self) -> None:
        """On CPU, oneDNN's kernels for the packed linears (:meth:`_warm_up_packed`), which otherwise
        the first requests build. Not in the constructor: an engine driven without its thread
        (tests, in-process benches) starts without the ~0.25 s it takes; ``AsyncLLMEngine`` calls
        it before it serves."""
        if self.device.type == "cpu" and self.leader is None:
            self.warmed_kernels = self._warm_up_packed(self.max_num_seqs, self.max_num_batched_tokens)

    def warm_up_thread(self) -> None:
        """On CPU, :meth:`_warm_up`'s prompt and decode on the calling thread (the engine's, before
        its first request; not under tensor parallelism, whose ranks wait for steps): a thread's
        first ops start its OpenMP team and pay other first-call costs (3-20 ms here), which the
        first request's first step otherwise pays."""
        if self.device.type == "cpu" and self.leader is None:
            self._warm_up()

    def _warm_up_packed(self, max_num_seqs: int, max_num_batched_tokens: int) -> int:
        """oneDNN's kernel for every row count a step can give the packed linears (CPU float32), built
        now rather than by the first requests: the LM head gets a row per sampled sequence, the others
        a row per token (up to the step's budget). Returns how many kernels ran (0: nothing packed)."""
        started = time.perf_counter()
        head, step_rows = self.model.lm_head, max(max_num_seqs, max_num_batched_tokens)
        ran = warm_packed_linears([(m, max_num_seqs if m is head else step_rows) for m in self.model.modules()
                                   if isinstance(m, ProductLinear)])
        if ran:
            log.info("built oneDNN's kernels for %d linear shapes x row counts (up to %d rows) in %.2f s", ran,
                     step_rows, time.perf_counter() - started)
        return ran

    def _capture_graphs(self, max_num_seqs: int, max_blocks_per_seq: int) -> None:
        buffers = DecodeBuffers(
            max_num_seqs, max_blocks_per_seq, self.kv_layout.block_size, self.scratch_block, self.device
        )
        graphs = CudaGraphRunner(self.model, self.kv_caches, buffers, graph_batch_sizes(max_num_seqs))
        try:
            with torch.inference_mode():
                self.graph_memory_bytes = graphs.capture()
        except Exception:  # a capture failure costs speed, not service
            log.warning("CUDA graph capture failed; decode steps run eagerly", exc_info=True)
            return
        self.graphs = graphs
        log.info("captured CUDA graphs for decode batch sizes %s (%.1f MiB)", graphs.sizes,
                 self.graph_memory_bytes / 2**20)

    def host_inputs(self, batch: ScheduledBatch) -> HostInputs:
        """The step's ids, positions, slots, lengths and block tables as host lists."""
        bs = self.kv_layout.block_size
        h = HostInputs([], [], [], [], [], [], [])
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            h.input_ids += seq.token_ids(start, end)
            h.positions += range(start, end)
            table = seq.block_table
            h.slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            h.seq_lens.append(end)
            h.block_tables.append(table)
            if end == seq.num_tokens:
                h.sample_rows.append(len(h.input_ids) - 1)
                h.sampled_seqs.append(seq)
        return h

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        """Pack the step's metadata into one host tensor, copy it once, and view it as the inputs."""
        h = self.host_inputs(batch)
        packed, sizes, width = self._pack(h, batch.num_new_tokens)
        if self.leader is not None:
            self.leader.send(STEP, sizes + [width], packed)
        return self._inputs(packed, sizes, width, list(batch.num_new_tokens), h.seq_lens, h.sampled_seqs)

    @torch.inference_mode()
    def follow_step(self, packed: torch.Tensor, sizes: list[int], width: int,
                    save_kv_layer: LayerHook | None = None) -> None:
        """A worker's part of the step rank 0 packed: the same forward (and logits) on its shard;
        ``save_kv_layer``: this rank's KV saves (``tp_ranks.RankFollower``)."""
        query_starts, seq_lens = packed.split(sizes)[4:6]
        inputs = self._inputs(packed, sizes, width, query_starts.diff().tolist(), seq_lens.tolist(), [])
        hidden = self.model.forward(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata,
                                    save_kv_layer)
        if sizes[3]:  # rows sampled on rank 0: the head's all-gather needs every rank
            self.model.compute_logits(hidden[inputs.sample_rows])

    def _pack(self, h: HostInputs, num_new_tokens: list[int]) -> tuple[torch.Tensor, list[int], int]:
        """The step's metadata as one int64 host tensor, its parts' sizes, and the block-table width."""
        num_seqs, num_tokens = len(h.seq_lens), len(h.input_ids)
        width = max(len(t) for t in h.block_tables)
        starts = [0]
        for n in num_new_tokens:
            starts.append(starts[-1] + n)
        flat = h.input_ids + h.positions + h.slots + h.sample_rows + starts + h.seq_lens
        for t in h.block_tables:
            flat += t
            flat += [0] * (width - len(t))
        sizes = [num_tokens] * 3 + [len(h.sample_rows), num_seqs + 1, num_seqs, num_seqs * width]
        return torch.tensor(flat, dtype=torch.int64), sizes, width

    def _inputs(self, packed: torch.Tensor, sizes: list[int], width: int, query_lens: list[int],
                seq_lens: list[int], sampled_seqs: list[Sequence]) -> ModelInputs:
        """Copy the packed host tensor to the device once and view it as the step's inputs."""
        if self.device.type != "cpu":
            packed = packed.pin_memory().to(self.device, non_blocking=True)
        ids, positions, slots, sample_rows, qsl, seq_lens_t, tables = packed.split(sizes)
        meta = AttentionMetadata(
            slot_mapping=slots, query_lens=query_lens, seq_lens=seq_lens,
            block_tables=tables.view(len(seq_lens), width), block_size=self.kv_layout.block_size,
            query_start_loc=qsl, seq_lens_tensor=seq_lens_t,
        )
        return ModelInputs(ids, positions, meta, sample_rows, sampled_seqs)

    def _graphable(self, batch: ScheduledBatch, save_kv_layer: LayerHook | None) -> bool:
        return (
            self.graphs is not None
            and save_kv_layer is None
            and len(batch.seqs) <= self.graphs.max_batch_size
            and all(n == 1 for n in batch.num_new_tokens)
        )

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, save_kv_layer: LayerHook | None = None) -> RunnerOutput:
        """Forward the batch, write its KV, and sample where a sequence is fully computed.

        ``save_kv_layer`` (the connector worker's hook, given only for a step that saves KV) is
        called after each layer.
        """
        if self._graphable(batch, save_kv_layer):
            h = self.host_inputs(batch)
            hidden = self.graphs.run(h.input_ids, h.positions, h.slots, h.seq_lens, h.block_tables)
            sample_rows, sampled_seqs = self._sample_rows(h.sample_rows, len(h.input_ids)), h.sampled_seqs
        else:
            inputs = self.prepare(batch)
            hidden = self.model.forward(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, save_kv_layer
            )
            sample_rows, sampled_seqs = inputs.sample_rows, inputs.sampled_seqs
        if not sampled_seqs:
            return RunnerOutput([], [], [])
        logits = self.model.compute_logits(hidden[sample_rows])
        rows = [SampleRow(s.params, s.num_tokens, len(s.output_token_ids), s.grammar, s.prompt_token_ids,
                          s.output_token_ids) for s in sampled_seqs]
        logits, rows, extra = expand_rows(logits, rows, sampled_seqs)
        out = self.sampler(logits, rows)
        firsts = split_choices(sampled_seqs, out.token_ids, out.logprobs, extra) if extra else {}
        return RunnerOutput(sampled_seqs, out.token_ids, out.logprobs, firsts)

    def close(self) -> None:
        """Stop the tensor-parallel workers (nothing at size 1); also done at exit."""
        if self.leader is not None:
            self.leader.close()

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy blocks' KV (``(from, to)`` ids) in every layer: a forked choice's own prompt tail."""
        if self.leader is not None:
            self.leader.send(COPY, [len(pairs)], torch.tensor(pairs, dtype=torch.int64).view(-1))
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]

    def _sample_rows(self, rows: list[int], num_rows: int) -> torch.Tensor | slice:
        if rows == list(range(num_rows)):
            return slice(0, num_rows)  # every decode row is sampled: no index copy
        return torch.tensor(rows, dtype=torch.int64).to(self.device, non_blocking=True)
