"""What one forward pass needs to know about the paged KV cache.

The batch is flat: the new tokens of every sequence in the step are concatenated
(``input_ids`` / ``positions`` have ``num_tokens`` entries). Sequence ``i`` contributes
``query_lens[i]`` new tokens and, after this step, has ``seq_lens[i]`` tokens of context
(cached + new). Each new token's K/V is written to ``slot_mapping`` (a flat slot index
``block_id * block_size + offset`` into a layer's cache viewed as
``[2, num_blocks * block_size, num_kv_heads, head_dim]``); attention for sequence ``i``
reads the first ``seq_lens[i]`` slots of its ``block_tables[i]`` row.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_lens: list[int]  # new tokens per sequence
    seq_lens: list[int]  # context length per sequence after this step
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int64, padded with 0
    block_size: int
    # Device copies of query offsets ([num_seqs + 1], cumulative query_lens) and seq_lens, when
    # the caller already has them (CUDA-graph buffers); backends that need them build them otherwise.
    query_start_loc: torch.Tensor | None = field(default=None, repr=False)
    seq_lens_tensor: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)
