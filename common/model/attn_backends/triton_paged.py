"""The Triton backend: one paged-attention kernel that reads K/V in place through block tables.

One launch per layer covers the whole flat batch, whatever it mixes: decode tokens, fresh
prompts (varlen: every sequence of the step in the same launch) and chunks continuing over
cached context. A program owns ``BLOCK_M`` consecutive query tokens of one sequence and one
KV head; its rows are those tokens times the head's query group, so grouped-query attention
reads each key once for the whole group. It walks the sequence's keys ``BLOCK_N`` at a time,
looking each key's block up in the block table (no gather into a padded copy), with an online
softmax in float32. Query row ``m`` of a sequence with ``context`` cached tokens sits at
position ``context + m`` and sees keys ``0..context + m``: one rule for decode, prefill and
chunked prefill.

The plan is three small tensors and one host int (the longest query), so a decode-only step
(all queries of length 1) has fixed shapes and can be replayed from a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from common.model.attention_metadata import AttentionMetadata


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, block_tables_ptr, seq_lens_ptr, query_start_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_P2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, ALIGNED: tl.constexpr,
):
    seq = tl.program_id(0)
    tile = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context = seq_len - q_len
    # the tile's first position: from the chunk's first query, or (ALIGNED) from a multiple of
    # BLOCK_M, so that a token sits in the same row of its tile however its prompt was chunked
    first = context + tile * BLOCK_M
    if ALIGNED:
        first -= context % BLOCK_M
    if first >= seq_len:  # the grid is sized for the longest query of the step
        return

    rows = tl.arange(0, BLOCK_M * GROUP_P2)
    m = first - context + rows // GROUP_P2  # query token within the chunk (ALIGNED: < 0 in a first tile)
    head = kv_head * GROUP + rows % GROUP_P2
    row_ok = (m >= 0) & (m < q_len) & (rows % GROUP_P2 < GROUP)
    d = tl.arange(0, HEAD_P2)
    d_ok = d < HEAD_DIM
    q_off = (q_start + m)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q_pos = context + m

    m_i = tl.full([BLOCK_M * GROUP_P2], -1e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * GROUP_P2], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * GROUP_P2, HEAD_P2], dtype=tl.float32)
    kv_end = tl.minimum(first + BLOCK_M, seq_len)  # the tile's last row sees this far
    for start in range(0, kv_end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_end
        block = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
        slot = n % BLOCK_SIZE
        kv_mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(
            k_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks + kv_head * stride_kh + d[None, :],
            mask=kv_mask, other=0.0,
        )
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        visible = (n[None, :] <= q_pos[:, None]) & n_ok[None, :]
        scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs + kv_head * stride_vh + d[None, :],
            mask=kv_mask, other=0.0,
        )
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # masked-off rows have l_i 0 and are not stored
    o_off = (q_start + m)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    tl.store(o_ptr + o_off, out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@dataclass
class TritonPlan:
    query_start_loc: torch.Tensor  # [S + 1]: sequence i's queries are flat rows qsl[i]:qsl[i+1]
    seq_lens: torch.Tensor  # [S]: tokens in the cache for sequence i after this step's write
    block_tables: torch.Tensor  # [S, W]
    max_query_len: int  # sizes the grid; 1 for a decode-only step


def build_plan(meta: AttentionMetadata, device: torch.device) -> TritonPlan:
    """The kernel's metadata, from ``meta``'s device tensors where it has them, else one host copy."""
    if meta.query_start_loc is not None and meta.seq_lens_tensor is not None:
        qsl, seq_lens = meta.query_start_loc, meta.seq_lens_tensor
    else:
        starts = [0]
        for q in meta.query_lens:
            starts.append(starts[-1] + q)
        host = torch.tensor(starts + meta.seq_lens, dtype=torch.int64)
        both = host.to(device, non_blocking=True)  # one copy for both
        qsl, seq_lens = both[: len(starts)], both[len(starts) :]
    tables = meta.block_tables.to(device).contiguous()  # the kernel steps along a row with stride 1
    return TritonPlan(qsl, seq_lens, tables, max(meta.query_lens))


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, plan: TritonPlan, scale: float,
                    invariant: bool = False) -> torch.Tensor:
    """``q`` [n, heads, d] (last dim contiguous) against ``kv_cache`` [2, blocks, bs, kv_heads, d]
    -> [n, heads, d]. ``invariant``: decode steps run prefill's tile shape too, so that a query's
    result never depends on what else its step holds (``--batch-invariant``)."""
    n, heads, d = q.shape
    _, _, block_size, kv_heads, _ = kv_cache.shape
    group = heads // kv_heads
    group_p2 = triton.next_power_of_2(group)
    decode = plan.max_query_len == 1 and not invariant
    rows = 16 if decode else 64  # tl.dot needs >= 16 rows; prefill tiles share each key load wider
    block_m = max(1, rows // group_p2)
    out = torch.empty(n, heads, d, dtype=q.dtype, device=q.device)
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    num_seqs = plan.seq_lens.shape[0]
    # ALIGNED tiles: a chunk may start mid-tile, so one tile more may be needed
    grid = (num_seqs, triton.cdiv(plan.max_query_len, block_m) + int(invariant), kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, plan.block_tables, plan.seq_lens, plan.query_start_loc, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), plan.block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_P2=group_p2,
        HEAD_DIM=d, HEAD_P2=max(16, triton.next_power_of_2(d)), BLOCK_M=block_m, BLOCK_N=64,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", ALIGNED=invariant,
    )
    return out


class TritonBackend:
    """Paged attention without gathers; its decode plans are CUDA-graph safe. ``invariant``
    (``--batch-invariant``): one tile shape for every step.

    Why that makes a query's result independent of its batch and chunking: a program owns one
    sequence's tile and walks its keys from position 0, ``BLOCK_N`` at a time, in one order;
    other sequences only add programs. Inside a tile a row's sums do not read the other rows
    (each row is its own dot products and its own online softmax), and a key block past the
    row's position adds exact zeros (its scores are -inf). Two things did depend on the step:
    the tile shape (16 rows for a decode-only step, 64 otherwise), and a token's row inside
    its tile (tiles started at the chunk's first token); a matmul need not round a row the same
    in every row of its tile (numpy's, which Triton's interpreter runs, does not). ``invariant``
    keeps 64 rows and starts tiles at multiples of the tile, so token ``p`` is always row
    ``p % BLOCK_M`` (``ALIGNED``)."""

    name = "triton"
    supports_cuda_graphs = True

    def __init__(self, invariant: bool = False) -> None:
        self.invariant = invariant

    def plan(self, meta: AttentionMetadata, device: torch.device) -> TritonPlan:
        return build_plan(meta, device)

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: TritonPlan,
        scale: float,
    ) -> torch.Tensor:
        n, heads, d = q.shape
        return paged_attention(q, kv_cache, plan, scale, self.invariant).view(n, heads * d)
