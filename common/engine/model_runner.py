"""Runs one scheduled batch through the model: flat tensors in, sampled tokens out.

The batch is flat (vLLM's layout): the new tokens of every scheduled sequence are
concatenated. Only sequences whose every token is computed after this step (a finished
prompt, a decode) are sampled; a prefill chunk that stops mid-prompt is not.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from common.engine.sampler import Sampler
from common.engine.scheduler import ScheduledBatch
from common.engine.sequence import Sequence
from common.kv_layout import KVLayout
from common.model.attention_metadata import AttentionMetadata


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


LayerHook = Callable[[int, torch.Tensor, list[Sequence], AttentionMetadata], None]


class ModelRunner:
    """Owns the model, the KV cache tensors (one per layer) and the sampler."""

    def __init__(self, model: torch.nn.Module, kv_layout: KVLayout, num_blocks: int, device: torch.device, seed: int):
        self.model = model
        self.kv_layout = kv_layout
        self.device = device
        self.kv_caches = [
            torch.zeros(kv_layout.layer_shape(num_blocks), dtype=kv_layout.torch_dtype, device=device)
            for _ in range(kv_layout.num_layers)
        ]
        self.sampler = Sampler(device, seed)

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        """Build input ids, positions, slot mapping and block tables on the host, then copy once."""
        bs = self.kv_layout.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sampled: list[Sequence] = []
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            input_ids += seq.token_ids(start, end)
            positions += range(start, end)
            table = seq.block_table
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sampled.append(seq)
        width = max(len(s.block_table) for s in batch.seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in batch.seqs]
        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots),
            query_lens=list(batch.num_new_tokens),
            seq_lens=seq_lens,
            block_tables=self._tensor(tables),
            block_size=bs,
        )
        return ModelInputs(self._tensor(input_ids), self._tensor(positions), meta, self._tensor(sample_rows), sampled)

    def _tensor(self, data: list) -> torch.Tensor:
        t = torch.tensor(data, dtype=torch.int64)
        return t.to(self.device, non_blocking=True) if self.device.type != "cpu" else t

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, save_kv_layer: LayerHook | None = None) -> RunnerOutput:
        """Forward the batch, write its KV, and sample where a sequence is fully computed.

        ``save_kv_layer`` (the producer connector's hook) is called after each layer of a
        step that contains prompt tokens.
        """
        inputs = self.prepare(batch)
        on_layer_done = None
        if save_kv_layer is not None and batch.has_prefill:
            seqs, meta = batch.seqs, inputs.attn_metadata

            def on_layer_done(i: int, kv_layer: torch.Tensor) -> None:
                save_kv_layer(i, kv_layer, seqs, meta)

        hidden = self.model.forward(
            inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata, on_layer_done=on_layer_done
        )
        if not inputs.sampled_seqs:
            return RunnerOutput([], [], [])
        logits = self.model.compute_logits(hidden[inputs.sample_rows])
        params = [s.params for s in inputs.sampled_seqs]
        out = self.sampler(logits, params, [s.generator for s in inputs.sampled_seqs])
        return RunnerOutput(inputs.sampled_seqs, out.token_ids, out.logprobs)
