"""The batch-invariant attention backend (``--batch-invariant``): pure torch, fixed splits.

SDPA's result for a query depends on how many queries share its call and on how long the key
axis is: both change with chunking, prefill against decode and the batch. Here every query's
result is computed from fixed-shape pieces, in a fixed order:

- queries in tiles of :data:`QUERY_TILE` tokens of one sequence (a decode token is a tile
  of its own, padded), a group's query heads folded into the tile's rows;
- keys in blocks of :data:`KEY_BLOCK` positions counted from position 0 of the sequence,
  every block scored with one ``[rows, d] @ [d, KEY_BLOCK]`` matmul of a batched ``bmm``
  (whose batch elements do not depend on the batch count, checked at start);
- the softmax subtracts the row's max over all its keys (a max is exact in any order), sums
  each block over its ``KEY_BLOCK`` keys, and adds the blocks' sums and ``p @ v`` products
  block by block from block 0. Key blocks past a row's last key are masked whole: their
  ``exp(-inf)`` is 0, so they add exact zeros and a batch that holds more blocks for a longer
  sequence changes no bit of a shorter one.

It costs more than SDPA: padded query tiles (a decode token computes a whole tile) and
masked blocks are computed, not skipped. Matches SDPA to float rounding (tests compare 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model.attention_metadata import AttentionMetadata

QUERY_TILE = 16
KEY_BLOCK = 64


@dataclass
class InvariantPlan:
    """Per-forward facts every layer reuses."""

    row_index: torch.Tensor  # [units * QUERY_TILE] flat query row of each tile slot; num_tokens = a zero row
    slot_of_row: torch.Tensor  # [num_tokens] tile slot of each flat query row
    key_slots: torch.Tensor  # [units, blocks * KEY_BLOCK] flat cache slot of each unit's keys
    visible: torch.Tensor  # [units, 1, blocks, QUERY_TILE, KEY_BLOCK] bool: the causal mask


def build_plan(meta: AttentionMetadata, device: torch.device) -> InvariantPlan:
    bs, n = meta.block_size, sum(meta.query_lens)
    num_blocks = max(-(-s // KEY_BLOCK) for s in meta.seq_lens)
    width = num_blocks * KEY_BLOCK
    tables = meta.block_tables.cpu()
    row_index, key_slots, positions, seq_lens = [], [], [], []
    start = 0
    for q, seq_len, table in zip(meta.query_lens, meta.seq_lens, tables):
        keys = torch.arange(seq_len)
        slots = torch.zeros(width, dtype=torch.int64)
        slots[:seq_len] = table[keys // bs] * bs + keys % bs
        for t in range(0, q, QUERY_TILE):
            rows = list(range(start + t, min(start + t + QUERY_TILE, start + q)))
            pad = QUERY_TILE - len(rows)
            row_index += rows + [n] * pad
            # query i of the sequence sits at position seq_len - q + i; a padding slot sees key 0 only
            positions.append([seq_len - q + r - start for r in rows] + [0] * pad)
            key_slots.append(slots)
            seq_lens.append(seq_len)
        start += q
    units = len(positions)
    pos = torch.tensor(positions)  # [units, QUERY_TILE]
    keys = torch.arange(width).view(num_blocks, 1, KEY_BLOCK)
    visible = keys[None] <= pos.view(units, 1, QUERY_TILE, 1)  # [units, blocks, QUERY_TILE, KEY_BLOCK]
    slot_of_row = torch.empty(n, dtype=torch.int64)
    index = torch.tensor(row_index)
    real = index < n
    slot_of_row[index[real]] = torch.arange(len(row_index))[real]
    return InvariantPlan(
        index.to(device), slot_of_row.to(device), torch.stack(key_slots).to(device),
        visible.unsqueeze(1).to(device),
    )


def invariant_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, plan: InvariantPlan, scale: float
) -> torch.Tensor:
    """``q`` [n, heads, d] against the keys in ``kv_cache`` through ``plan``; returns [n, heads * d]."""
    n, heads, d = q.shape
    kv_heads = kv_cache.shape[-2]
    group = heads // kv_heads
    units, width = plan.key_slots.shape
    blocks = width // KEY_BLOCK
    rows = QUERY_TILE * group
    flat = kv_cache.view(2, -1, kv_heads, d)
    # keys, values: [units, kv_heads, blocks, KEY_BLOCK, d]
    k = flat[0][plan.key_slots].view(units, blocks, KEY_BLOCK, kv_heads, d).permute(0, 3, 1, 2, 4).to(q.dtype)
    v = flat[1][plan.key_slots].view(units, blocks, KEY_BLOCK, kv_heads, d).permute(0, 3, 1, 2, 4).to(q.dtype)
    padded = torch.cat([q, q.new_zeros(1, heads, d)])[plan.row_index]  # [units * QUERY_TILE, heads, d]
    # rows of a tile: (query head in the group, query token), for each KV head
    tiles = padded.view(units, QUERY_TILE, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(units, kv_heads, 1, rows, d)
    tiles = tiles.expand(units, kv_heads, blocks, rows, d).reshape(-1, rows, d)
    scores = torch.bmm(tiles, k.reshape(-1, KEY_BLOCK, d).transpose(1, 2)).view(units, kv_heads, blocks, group,
                                                                                   QUERY_TILE, KEY_BLOCK)
    scores = (scores * scale).masked_fill(~plan.visible.unsqueeze(3), float("-inf"))
    p = torch.exp(scores - scores.amax(dim=(2, 5), keepdim=True))
    sums = p.sum(-1)  # [units, kv_heads, blocks, group, QUERY_TILE]
    pv = torch.bmm(p.view(-1, rows, KEY_BLOCK), v.reshape(-1, KEY_BLOCK, d)).view(units, kv_heads, blocks, rows, d)
    acc, total = pv[:, :, 0], sums[:, :, 0]
    for j in range(1, blocks):  # block by block from block 0: the order every batch shares
        acc, total = acc + pv[:, :, j], total + sums[:, :, j]
    out = acc / total.reshape(units, kv_heads, rows, 1)  # [units, kv_heads, rows, d]
    out = out.view(units, kv_heads, group, QUERY_TILE, d).permute(0, 3, 1, 2, 4).reshape(-1, heads * d)
    return out[plan.slot_of_row]


class InvariantBackend:
    """Batch-invariant attention (see the module docstring); CPU and CUDA, never CUDA-graphed."""

    name = "invariant"
    supports_cuda_graphs = False

    def plan(self, meta: AttentionMetadata, device: torch.device) -> InvariantPlan:
        return build_plan(meta, device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: InvariantPlan,
        scale: float,
    ) -> torch.Tensor:
        return invariant_attention(q, kv_cache, plan, scale)
