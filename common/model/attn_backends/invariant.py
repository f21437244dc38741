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

It costs more than SDPA: padded query tiles (a decode token computes a whole tile: 4 tokens,
a compromise between decode's waste and prefill's copies of the keys per tile) and masked
blocks are computed, not skipped. Matches SDPA to float rounding (tests compare 1e-5).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.model.attention_metadata import AttentionMetadata

QUERY_TILE = 4  # query tokens per tile, decode and prefill alike
KEY_BLOCK = 64  # keys per block, counted from position 0
MAX_GATHERED_KEYS = 1 << 16  # key positions gathered at once: 48 MiB each of fp32 K and V at 3 KV heads of 64


@dataclass
class InvariantPlan:
    """Per-forward facts every layer reuses (a unit = one query tile of one sequence)."""

    row_index: torch.Tensor  # [units * QUERY_TILE] flat query row of each tile slot; num_tokens = a zero row
    slot_of_row: torch.Tensor  # [num_tokens] tile slot of each flat query row
    key_slots: torch.Tensor  # [units, blocks * KEY_BLOCK] flat cache slot of each unit's keys
    masked: torch.Tensor  # [units, 1, blocks, 1, QUERY_TILE, KEY_BLOCK] bool: True = may not attend


def build_plan(meta: AttentionMetadata, device: torch.device) -> InvariantPlan:
    bs, n = meta.block_size, sum(meta.query_lens)
    query_lens, seq_lens = torch.tensor(meta.query_lens), torch.tensor(meta.seq_lens)
    blocks = -(-max(meta.seq_lens) // KEY_BLOCK)
    tiles = -(-query_lens // QUERY_TILE)
    unit_seq = torch.repeat_interleave(torch.arange(len(tiles)), tiles)
    first_unit = torch.cumsum(tiles, 0) - tiles
    row = ((torch.arange(len(unit_seq)) - first_unit[unit_seq]) * QUERY_TILE)[:, None] + torch.arange(QUERY_TILE)
    valid = row < query_lens[unit_seq, None]  # [units, QUERY_TILE]; the rest pads the sequence's last tile
    seq_start = torch.cumsum(query_lens, 0) - query_lens
    row_index = torch.where(valid, seq_start[unit_seq, None] + row, n)
    # query r of a sequence sits at position seq_len - query_len + r; a padding slot sees key 0 only
    positions = torch.where(valid, (seq_lens - query_lens)[unit_seq, None] + row, 0)
    keys = torch.arange(blocks * KEY_BLOCK)
    tables = meta.block_tables.cpu()
    slots = tables[:, (keys // bs).clamp(max=tables.shape[1] - 1)] * bs + keys % bs
    slots = slots.masked_fill(keys >= seq_lens[:, None], 0)  # past the sequence: any slot, masked below
    masked = keys.view(blocks, 1, KEY_BLOCK) > positions[:, None, :, None]  # [units, blocks, QUERY_TILE, KEY_BLOCK]
    return InvariantPlan(
        row_index.view(-1).to(device), torch.nonzero(valid.view(-1)).squeeze(1).to(device),
        slots[unit_seq].to(device), masked[:, None, :, None].to(device),
    )


def invariant_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, plan: InvariantPlan, scale: float
) -> torch.Tensor:
    """``q`` [n, heads, d] against the keys in ``kv_cache`` through ``plan``; returns [n, heads * d].

    Each unit gathers its own copy of its sequence's keys, so units go in groups of at most
    :data:`MAX_GATHERED_KEYS` keys (a long prompt's chunk would otherwise copy its context once
    per tile at once); a unit's result does not depend on its group."""
    n, heads, d = q.shape
    units, width = plan.key_slots.shape
    padded = torch.cat([q, q.new_zeros(1, heads, d)]).index_select(0, plan.row_index)
    tiles = padded.view(units, QUERY_TILE, heads, d)
    step = max(1, MAX_GATHERED_KEYS // width)
    out = torch.cat([
        _attend(tiles[u : u + step], kv_cache, plan.key_slots[u : u + step], plan.masked[u : u + step], scale)
        for u in range(0, units, step)
    ])
    return out.view(-1, heads * d).index_select(0, plan.slot_of_row)


def _attend(tiles: torch.Tensor, kv_cache: torch.Tensor, key_slots: torch.Tensor, masked: torch.Tensor,
            scale: float) -> torch.Tensor:
    """Query tiles [units, QUERY_TILE, heads, d] against their keys; returns the same shape."""
    units, _, heads, d = tiles.shape
    kv_heads = kv_cache.shape[-2]
    group = heads // kv_heads
    blocks = key_slots.shape[1] // KEY_BLOCK
    rows = QUERY_TILE * group
    flat = kv_cache.view(2, -1, kv_heads, d)
    k, v = (_gather(flat[i], key_slots).to(tiles.dtype) for i in (0, 1))  # [units, kv_heads, blocks, KEY_BLOCK, d]
    # rows of a tile: (query head in the group, query token), for each KV head
    q = tiles.view(units, QUERY_TILE, kv_heads, group, d).permute(0, 2, 3, 1, 4).reshape(units, kv_heads, 1, rows, d)
    q = q.expand(units, kv_heads, blocks, rows, d).reshape(-1, rows, d)
    scores = torch.bmm(q, k.reshape(-1, KEY_BLOCK, d).transpose(1, 2)).view(units, kv_heads, blocks, group,
                                                                              QUERY_TILE, KEY_BLOCK)
    scores = (scores * scale).masked_fill_(masked, float("-inf"))
    p = torch.exp(scores - scores.amax(dim=(2, 5), keepdim=True))
    sums = p.sum(-1)  # [units, kv_heads, blocks, group, QUERY_TILE]
    pv = torch.bmm(p.view(-1, rows, KEY_BLOCK), v.reshape(-1, KEY_BLOCK, d)).view(units, kv_heads, blocks, rows, d)
    acc, total = pv[:, :, 0], sums[:, :, 0]
    for j in range(1, blocks):  # block by block from block 0: the order every batch shares
        acc, total = acc + pv[:, :, j], total + sums[:, :, j]
    out = acc / total.reshape(units, kv_heads, rows, 1)  # [units, kv_heads, rows, d]
    return out.view(units, kv_heads, group, QUERY_TILE, d).permute(0, 3, 1, 2, 4)


def _gather(cache: torch.Tensor, key_slots: torch.Tensor) -> torch.Tensor:
    units, width = key_slots.shape
    keys = cache.index_select(0, key_slots.view(-1))  # one row copy per key (advanced indexing is slower)
    return keys.view(units, width // KEY_BLOCK, KEY_BLOCK, *cache.shape[1:]).permute(0, 3, 1, 2, 4)


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
