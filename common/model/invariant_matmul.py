"""``--batch-invariant``'s linears on a GPU: one Triton matmul whose tiles never depend on M.

cuBLAS picks its kernel by the shape of the call, split-K included, so a token's product
depends on how many tokens share its step. This kernel sums every output over the input axis
``BLOCK_K`` at a time, in order, from 0, in float32, in ``BLOCK_M`` x ``BLOCK_N`` output tiles;
no split of the input axis. A row's result is then the same whatever the rows around it (a
batch only adds or removes whole tiles, and a row's place inside a tile does not change its
sums: checked at start, ``rows_invariant``). Its tiles are ``SMALL``'s, and ``LARGE``'s from
``LARGE_FROM`` rows only where a start-up check (:func:`large_tiles_agree`) finds they give
every row the same bits.

Unlike ``tiled_linear``'s batched matmul, every weight tile is read once per ``BLOCK_M`` rows,
so a long prompt's chunk does not re-read the whole weight per 16 rows; and unlike a host
choice of kernel, it is CUDA-graph safe. Triton compiles it once per tile configuration; on
CPU tensors it runs in Triton's interpreter (the tests' stand-in for a GPU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_K = 64  # the input axis is summed 64 at a time, in order, whatever the tile
# (BLOCK_M, BLOCK_N, warps, stages): 64 x 64 keeps decode's few rows on many SMs; a long chunk
# runs faster on 128 x 128 tiles, used from LARGE_FROM rows only where it gives SMALL's bits
SMALL, LARGE = (64, 64, 4, 3), (128, 128, 8, 3)
LARGE_FROM = 256

@triton.jit
def _matmul_kernel(
    x_ptr, w_ptr, b_ptr, o_ptr, M, N, K, stride_xm, stride_wn, stride_om,
    HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    m_ok, n_ok = rm < M, rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_cols = w_ptr + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + rk
        k_ok = k < K
        a = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    out = o_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     large_from: int | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for ``x`` [..., in], ``weight`` [out, in], each row's result
    independent of the others (see the module docstring); ``LARGE`` tiles from ``large_from`` rows
    (None: never)."""
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, k = rows.shape
    n = weight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m:
        block_m, block_n, warps, stages = LARGE if large_from is not None and m >= large_from else SMALL
        grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
        _matmul_kernel[grid](
            rows, weight, bias if bias is not None else weight, out, m, n, k,
            rows.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=BLOCK_K,
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
        )
    return out.view(*x.shape[:-1], n)


def large_tiles_agree(weights: list[torch.Tensor], rows: int = LARGE_FROM + 44) -> bool:
    """Whether ``LARGE`` tiles give every row ``SMALL``'s bits on each of ``weights`` (a matter of
    how the GPU's matrix instructions sum, so checked at start, on this GPU)."""
    gen = torch.Generator().manual_seed(2)
    for w in weights:
        x = torch.randn(rows, w.shape[1], generator=gen).to(w.device, w.dtype)
        if not torch.equal(invariant_linear(x, w, None), invariant_linear(x, w, None, large_from=rows)):
            return False
    return True
