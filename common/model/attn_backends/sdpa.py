"""The SDPA backend: paged attention with plain ``scaled_dot_product_attention`` (CPU default).

Every step first writes the new tokens' K/V at ``slot_mapping``, then attends:
- decode tokens (one new token per sequence) of the whole batch together: their blocks are
  gathered into one padded tensor and one SDPA call runs with a padding mask;
- prefill sequences (a whole prompt or a chunk continuing an earlier one) one by one: a
  fresh prompt with ``is_causal`` (no mask), a chunk with a causal mask offset by the
  tokens already cached.

Every SDPA call gets 4-D inputs: PyTorch's CPU flash kernel only takes 4-D tensors, and a
3-D call silently falls back to the math path (a full score matrix, ~10x slower at 512
tokens). Grouped-query attention never copies K/V per query head: decode folds a group's
query heads into the query axis (``[B, kv_heads, group, d]``, all at one position),
prefill passes ``enable_gqa``. ``AttentionPlan`` holds what every layer shares (indices,
masks), built once per forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from common.model.attention_metadata import AttentionMetadata


@dataclass
class PrefillSlice:
    start: int  # first token of this sequence in the flat batch
    end: int
    seq_len: int
    block_ids: torch.Tensor | None  # blocks to gather; None when the prompt is all new
    mask: torch.Tensor | None  # [q_len, seq_len] bool, True = may attend; None: plain causal


@dataclass
class AttentionPlan:
    """Per-forward facts every layer's attention reuses."""

    block_size: int
    num_tokens: int
    decode_token_idx: torch.Tensor | None = None  # None with decode-only batches: all tokens
    decode_block_ids: torch.Tensor | None = None  # [B * blocks], row-major: sequence, then block
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, blocks * block_size]
    prefills: list[PrefillSlice] = field(default_factory=list)


def build_plan(meta: AttentionMetadata, device: torch.device) -> AttentionPlan:
    """Precompute gather indices and masks for ``meta``."""
    bs = meta.block_size
    block_tables = meta.block_tables.to(device)
    plan = AttentionPlan(block_size=bs, num_tokens=sum(meta.query_lens))
    starts = [0]
    for q in meta.query_lens:
        starts.append(starts[-1] + q)
    decode_rows = [i for i, q in enumerate(meta.query_lens) if q == 1]
    if decode_rows:
        lens = [meta.seq_lens[i] for i in decode_rows]
        num_blocks = -(-max(lens) // bs)
        rows = torch.tensor(decode_rows, device=device)
        tables = block_tables[rows] if len(decode_rows) < meta.num_seqs else block_tables
        plan.decode_block_ids = tables[:, :num_blocks].flatten()
        seq_lens = torch.tensor(lens, device=device)
        visible = torch.arange(num_blocks * bs, device=device) < seq_lens[:, None]
        plan.decode_mask = visible[:, None, None, :]
        if len(decode_rows) < meta.num_seqs:
            plan.decode_token_idx = torch.tensor([starts[i] for i in decode_rows], device=device)
    for i, q in enumerate(meta.query_lens):
        if q == 1:
            continue
        seq_len = meta.seq_lens[i]
        context = seq_len - q
        if context == 0:  # the whole prompt is new: is_causal lets the kernel skip masked tiles
            plan.prefills.append(PrefillSlice(starts[i], starts[i + 1], seq_len, None, None))
            continue
        keys = torch.arange(seq_len, device=device)
        queries = torch.arange(context, seq_len, device=device)
        mask = keys[None, :] <= queries[:, None]
        block_ids = block_tables[i, : -(-seq_len // bs)]
        plan.prefills.append(PrefillSlice(starts[i], starts[i + 1], seq_len, block_ids, mask))
    return plan


def paged_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan,
    scale: float,
) -> torch.Tensor:
    """Attention for a flat batch; ``q`` [n, heads, d], ``k``/``v`` [n, kv_heads, d] (already cached).

    Returns [n, heads * d].
    """
    n, heads, d = q.shape
    kv_heads = kv_cache.shape[-2]
    group = heads // kv_heads
    if plan.decode_token_idx is None and not plan.prefills:
        return _decode(q, kv_cache, plan, scale).reshape(n, heads * d)
    out = q.new_empty(n, heads * d)
    if plan.decode_mask is not None:
        idx = plan.decode_token_idx
        out[idx] = _decode(q[idx], kv_cache, plan, scale).reshape(len(idx), heads * d)
    for p in plan.prefills:
        if p.block_ids is None:
            keys, values = k[p.start : p.end], v[p.start : p.end]
        else:
            keys, values = _gather(kv_cache, p.block_ids, p.seq_len)
        q_len = p.end - p.start
        o = F.scaled_dot_product_attention(
            q[p.start : p.end].transpose(0, 1)[None],  # [1, heads, q_len, d]
            keys.transpose(0, 1)[None].to(q.dtype),
            values.transpose(0, 1)[None].to(q.dtype),
            attn_mask=p.mask,
            is_causal=p.mask is None,
            scale=scale,
            enable_gqa=group > 1,
        )
        out[p.start : p.end] = o[0].transpose(0, 1).reshape(q_len, heads * d)
    return out


def _gather_blocks(kv_cache: torch.Tensor, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # index_select on each contiguous half: one row copy per block (advanced indexing
    # over kv_cache[:, ids] was 10-50x slower on CPU).
    return kv_cache[0].index_select(0, block_ids), kv_cache[1].index_select(0, block_ids)


def _gather(
    kv_cache: torch.Tensor, block_ids: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = _gather_blocks(kv_cache, block_ids)  # [blocks, bs, kv_heads, d]
    return k.flatten(0, 1)[:seq_len], v.flatten(0, 1)[:seq_len]


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan, scale: float) -> torch.Tensor:
    """One query token per sequence; returns [B, heads, d]."""
    b, heads, d = q.shape
    kv_heads = kv_cache.shape[-2]
    k, v = _gather_blocks(kv_cache, plan.decode_block_ids)  # [B * blocks, bs, kv_heads, d]
    keys = k.view(b, -1, kv_heads, d).transpose(1, 2).to(q.dtype)  # [B, kv_heads, L, d]
    values = v.view(b, -1, kv_heads, d).transpose(1, 2).to(q.dtype)
    qs = q.view(b, kv_heads, heads // kv_heads, d)  # the group's heads share one key row
    o = F.scaled_dot_product_attention(qs, keys, values, attn_mask=plan.decode_mask, scale=scale)
    return o.view(b, heads, d)


class SdpaBackend:
    """Gathers blocks and calls SDPA; exact on CPU, the reference every other backend is tested against."""

    name = "sdpa"
    supports_cuda_graphs = False  # plans have host-dependent shapes (gathered lengths, per-prefill calls)

    def plan(self, meta: AttentionMetadata, device: torch.device) -> AttentionPlan:
        return build_plan(meta, device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: AttentionPlan,
        scale: float,
    ) -> torch.Tensor:
        return paged_attention(q, k, v, kv_cache, plan, scale)
