"""The fused Triton kernels (RMSNorm, rotary, SiLU-and-mul) equal the PyTorch ops they replace on CUDA.

Without a GPU they run in Triton's interpreter (tests/conftest.py sets it for the test process).
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
