"""The fused Triton kernels (RMSNorm, rotary, SiLU-and-mul) equal the PyTorch ops they replace on CUDA.

Without a GPU they run in Triton's interpreter (tests/conftest.py sets it for the test process),
in float32 and in the half types a GPU serves, float16 and bfloat16. Numpy has no bfloat16: the
interpreter keeps bf16 values as their uint16 bits and converts them only in casts (``.to``),
so a kernel that does arithmetic on bf16 operands computes on integers there (the kernels
upcast first; ``_rms_norm_kernel`` says why that costs nothing on a GPU), and its float32 ->
bf16 casts truncate where torch and the GPU round to nearest: up to one ulp per rounding,
which the tolerances below allow.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from common.model.layers import RMSNorm, RotaryEmbedding
from common.model.layers import apply_rotary as torch_rotary

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU-interpreter tests; on CUDA the gpu-marked model tests cover the compiled kernels",
                allow_module_level=True)
from common.model import fused_ops  # noqa: E402  (after the skip: imports triton)


@pytest.mark.parametrize("shape", [(5, 64), (3, 7, 24), (1, 100)])
def test_rms_norm_on_a_strided_view(shape):
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(shape[-1], 1e-6)
    norm.weight.data = torch.randn(shape[-1], generator=g)
    row = math.prod(shape[1:])
    x = torch.randn(shape[0], 2 * row, generator=g)[:, :row].view(shape)  # rows not contiguous
    torch.testing.assert_close(fused_ops.rms_norm(x, norm.weight, 1e-6), norm(x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "head_dim"), [(4, 16), (14, 64), (3, 24)])
def test_rotary_on_a_strided_projection(heads, head_dim):
    g = torch.Generator().manual_seed(1)
    rope = RotaryEmbedding(head_dim, 256, 10000.0, None)
    positions = torch.tensor([0, 5, 17, 200, 3])
    cos, sin = rope(positions)
    qkv = torch.randn(5, heads * head_dim + 32, generator=g)
    q = qkv[:, : heads * head_dim].view(5, heads, head_dim)  # as the qkv projection's split gives it
    got = fused_ops.apply_rotary(q, cos, sin)
    torch.testing.assert_close(got, torch_rotary(q, cos, sin), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("size", [128, 1500])
def test_silu_and_mul(size):
    g = torch.Generator().manual_seed(2)
    gate_up = torch.randn(3, 2 * size, generator=g)
    gate, up = gate_up.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate) * up
    torch.testing.assert_close(fused_ops.silu_and_mul(gate_up), want, rtol=1e-5, atol=1e-5)


HALF = [torch.float16, torch.bfloat16]


def assert_rounded(got: torch.Tensor, want: torch.Tensor, ulps: int) -> None:
    """``got`` is ``want`` rounded to ``got``'s dtype ``ulps`` times, each within one ulp."""
    eps = torch.finfo(got.dtype).eps
    torch.testing.assert_close(got.float(), want.float(), rtol=ulps * eps, atol=1e-5)


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_rms_norm_in_half_precision(dtype):
    """As the eager op in ``dtype``: the normed x rounded to ``dtype``, times the weight, rounded again."""
    g = torch.Generator().manual_seed(3)
    norm = RMSNorm(24, 1e-6)
    norm.weight.data = torch.randn(24, generator=g)
    norm.to(dtype)
    x = torch.randn(3, 2 * 7 * 24, generator=g).to(dtype)[:, : 7 * 24].view(3, 7, 24)
    got = fused_ops.rms_norm(x, norm.weight, 1e-6)
    assert got.dtype == dtype
    assert_rounded(got, norm(x), ulps=3)  # two roundings each side; torch's half ulp from nearest


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_rotary_in_half_precision(dtype):
    """Float32 math on the half-precision x, rounded once."""
    g = torch.Generator().manual_seed(4)
    cos, sin = RotaryEmbedding(64, 256, 10000.0, None)(torch.tensor([0, 5, 17, 200, 3]))
    q = torch.randn(5, 14 * 64 + 32, generator=g).to(dtype)[:, : 14 * 64].view(5, 14, 64)
    got = fused_ops.apply_rotary(q, cos, sin)
    assert got.dtype == dtype
    assert_rounded(got, torch_rotary(q.float(), cos, sin), ulps=1)


@pytest.mark.parametrize("dtype", HALF, ids=["float16", "bfloat16"])
def test_silu_and_mul_in_half_precision(dtype):
    """Float32 math on the half-precision gate and up, rounded once (1500: a masked second column block)."""
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(3, 2 * 1500, generator=g).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    got = fused_ops.silu_and_mul(gate_up)
    assert got.dtype == dtype
    assert_rounded(got, torch.nn.functional.silu(gate) * up, ulps=1)
