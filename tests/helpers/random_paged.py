"""Random paged KV caches with scattered block tables, for attention-backend tests."""

from __future__ import annotations

import torch

from common.model.attention_metadata import AttentionMetadata


def random_step(query_lens, seq_lens, kv_heads, head_dim, block_size, seed=0):
    """A cache of scattered blocks holding each sequence's keys, and this step's flat q/k/v/metadata."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 5  # spare blocks the tables never name
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g)
    ids = torch.randperm(num_blocks, generator=g).tolist()  # holes: no sequence's blocks are contiguous
    width = max(blocks_per_seq) + 2  # padded columns past every sequence's last block
    tables, slots, ks, vs = [], [], [], []
    for q, s, nb in zip(query_lens, seq_lens, blocks_per_seq):
        row = [ids.pop() for _ in range(nb)]
        tables.append(row + [0] * (width - nb))
        for pos in range(s - q, s):
            slot = row[pos // block_size] * block_size + pos % block_size
            slots.append(slot)
            ks.append(cache[0].flatten(0, 1)[slot])
            vs.append(cache[1].flatten(0, 1)[slot])
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_lens=list(query_lens), seq_lens=list(seq_lens),
        block_tables=torch.tensor(tables), block_size=block_size,
    )
    return cache, torch.stack(ks), torch.stack(vs), meta, g
