"""A minimal paged-KV driver for model tests: block tables, slot mappings, one forward per step.

It stands in for the engine's scheduler and block manager so model tests can prefill in
chunks, decode token by token and mix sequences in one batch, with deliberately
scattered (non-contiguous, reversed) block ids.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from common.model.attention_metadata import AttentionMetadata
from common.model.llama import CausalLM


@dataclass
class PagedSeq:
    token_ids: list[int]
    block_ids: list[int]
    num_cached: int = 0  # tokens whose K/V are already in the cache
    outputs: list[torch.Tensor] = field(default_factory=list)  # logits rows, one per computed token


class PagedCache:
    """KV caches for ``model`` plus a scattered block allocator."""

    def __init__(self, model: CausalLM, num_blocks: int = 64, block_size: int = 4) -> None:
        cfg = model.config
        self.model = model
        self.block_size = block_size
        weight = model.lm_head.weight
        self.device = weight.device
        layout = cfg.kv_layout(block_size, str(weight.dtype).removeprefix("torch."))
        self.kv_caches = [
            torch.zeros(layout.layer_shape(num_blocks), dtype=weight.dtype, device=self.device)
            for _ in range(cfg.num_layers)
        ]
        self.free = list(range(num_blocks - 1, 0, -1))  # handed out high ids first; block 0 unused

    def new_seq(self, token_ids: list[int]) -> PagedSeq:
        blocks_needed = -(-len(token_ids) // self.block_size)
        blocks = [self.free.pop(i % 2 - 1) for i in range(blocks_needed)]  # alternate ends: scattered
        return PagedSeq(list(token_ids), blocks)

    def step(self, work: list[tuple[PagedSeq, int]], on_layer_done: Callable[[int, torch.Tensor], None] | None = None) -> None:
        """One forward: each ``(seq, n)`` computes its next ``n`` uncached tokens; logits are appended."""
        ids, positions, slots, query_lens, seq_lens = [], [], [], [], []
        for seq, n in work:
            start = seq.num_cached
            for pos in range(start, start + n):
                ids.append(seq.token_ids[pos])
                positions.append(pos)
                slots.append(seq.block_ids[pos // self.block_size] * self.block_size + pos % self.block_size)
            query_lens.append(n)
            seq_lens.append(start + n)
        width = max(len(seq.block_ids) for seq, _ in work)
        tables = torch.tensor([seq.block_ids + [0] * (width - len(seq.block_ids)) for seq, _ in work])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, device=self.device), query_lens=query_lens, seq_lens=seq_lens,
            block_tables=tables.to(self.device), block_size=self.block_size,
        )
        ids_t = torch.tensor(ids, device=self.device)
        hidden = self.model(ids_t, torch.tensor(positions, device=self.device), self.kv_caches, meta, on_layer_done)
        logits = self.model.compute_logits(hidden)
        offset = 0
        for seq, n in work:
            seq.outputs.extend(logits[offset : offset + n].cpu())
            seq.num_cached += n
            offset += n
