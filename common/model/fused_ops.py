"""Fused Triton kernels for the small per-layer ops on CUDA: RMSNorm, rotary embedding, SiLU-and-mul.

In eager PyTorch each of these is 2-10 element-wise kernels (RMSNorm in float32 alone is
seven); a decode step of a 32-layer model then runs over a thousand tiny kernels, and even
replayed from a CUDA graph each costs microseconds. One kernel each computes the same float32
math and rounds once. ``common.model.layers`` calls these for CUDA tensors when triton is
installed; CPU keeps the PyTorch ops (exact parity with transformers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, o_ptr, inner, stride_x0, stride_x1, stride_o0, stride_o1, dim, eps,
                     BLOCK: tl.constexpr):
    row = tl.program_id(0)
    r0, r1 = row // inner, row % inner  # x is [rows0, inner, dim]; a 2-D x has inner 1
    cols = tl.arange(0, BLOCK)
    mask = cols < dim
    x = tl.load(x_ptr + r0 * stride_x0 + r1 * stride_x1 + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / dim + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # As the reference, weight * normed.to(dtype), rounding twice. The product of two 16-bit floats
    # is exact in float32, so multiplying there and rounding at the store is the 16-bit multiply
    # to the bit, and keeps bf16 arithmetic out of the kernel: Triton's CPU interpreter has none.
    out = w * y.to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + r0 * stride_o0 + r1 * stride_o1 + cols, out.to(o_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of ``x`` [n, d] or [n, heads, d] (last dim contiguous)."""
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    n, inner, dim = x3.shape
    out = torch.empty(n, inner, dim, dtype=x.dtype, device=x.device)
    _rms_norm_kernel[(n * inner,)](
        x3, weight, out, inner, x3.stride(0), x3.stride(1), out.stride(0), out.stride(1), dim, eps,
        BLOCK=triton.next_power_of_2(dim),
    )
    return out.view(x.shape)


@triton.jit
def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, o_ptr, heads, half, stride_xt, stride_xh, stride_ct, stride_st,
                   stride_ot, stride_oh, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK_H)
    c = tl.arange(0, BLOCK_D)
    c_ok = c < half
    mask = (h < heads)[:, None] & c_ok[None, :]
    src = x_ptr + t * stride_xt + h[:, None] * stride_xh + c[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    cos = tl.load(cos_ptr + t * stride_ct + c, mask=c_ok, other=0.0)[None, :]
    sin = tl.load(sin_ptr + t * stride_st + c, mask=c_ok, other=0.0)[None, :]
    dst = o_ptr + t * stride_ot + h[:, None] * stride_oh + c[None, :]
    tl.store(dst, (x1 * cos - x2 * sin).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, (x2 * cos + x1 * sin).to(o_ptr.dtype.element_ty), mask=mask)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` [n, heads, d] rotated by ``cos``/``sin`` [n, 1, d / 2] (float32), as ``layers.apply_rotary``."""
    n, heads, d = x.shape
    out = torch.empty(n, heads, d, dtype=x.dtype, device=x.device)
    _rotary_kernel[(n,)](
        x, cos, sin, out, heads, d // 2, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        out.stride(0), out.stride(1),
        BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(d // 2),
    )
    return out


@triton.jit
def _silu_and_mul_kernel(x_ptr, o_ptr, size, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < size
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + size + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptr + row * stride_o + cols, (gate / (1.0 + tl.exp(-gate)) * up).to(o_ptr.dtype.element_ty),
             mask=mask)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up`` [n, 2 * size] (gate first), in one pass."""
    n, two_size = gate_up.shape
    size = two_size // 2
    out = torch.empty(n, size, dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_and_mul_kernel[(n, triton.cdiv(size, block))](
        gate_up, out, size, gate_up.stride(0), out.stride(0), BLOCK=block
    )
    return out
