"""On CUDA: the compiled Triton kernel equals SDPA in fp16 and bf16 on odd block tables.

test_attn_gpu.py checks bf16 at Llama-8B's heads with blocks of 16; the CPU interpreter
(test_attn_triton.py) checks odd shapes in float32 only. Here the compiled kernel meets both
half-precision dtypes on the shapes most likely to break a tiled kernel: block sizes that do
not divide its key tile, head dims that are not powers of two, Qwen2.5-0.5B's group of 7,
block ids scattered at random and tables padded past each sequence's last block.
Skipped without a GPU.
"""

from __future__ import annotations

import pytest
import torch

from common.model.attn_backends.sdpa import SdpaBackend
from helpers.random_paged import random_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton_paged = pytest.importorskip("common.model.attn_backends.triton_paged")

# fp16 keeps 11 bits of mantissa, bf16 8: two correct implementations differ by about 2^-bits
RTOL = {torch.float16: 4e-3, torch.bfloat16: 2e-2}

STEPS = {
    "decode": ([1] * 9, [1, 2, 3, 17, 48, 49, 95, 300, 1021]),
    "varlen_prefill": ([1, 5, 37, 130], [1, 5, 37, 130]),
    "chunks_over_context": ([3, 64, 1, 17], [40, 200, 999, 18]),
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), [
    (14, 2, 64, 16),  # Qwen2.5-0.5B: group 7
    (8, 2, 24, 3),  # head dim and block size not powers of two
    (32, 8, 128, 5),  # Llama-8B heads, blocks straddling every key tile
    (4, 4, 80, 32),  # no grouping, head dim 80
])
def test_compiled_kernel_matches_sdpa(dtype, step, heads, kv_heads, head_dim, block_size):
    query_lens, seq_lens = STEPS[step]
    cache, k, v, meta, g = random_step(query_lens, seq_lens, kv_heads, head_dim, block_size)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=g)
    dev = torch.device("cuda")
    cache, k, v, q = (t.to(dev, dtype) for t in (cache, k, v, q))
    meta.slot_mapping, meta.block_tables = meta.slot_mapping.to(dev), meta.block_tables.to(dev)
    scale = head_dim**-0.5
    sdpa, tri = SdpaBackend(), triton_paged.TritonBackend()
    want = sdpa.forward(q, k, v, cache, sdpa.plan(meta, dev), scale).float()
    got = tri.forward(q, k, v, cache.clone(), tri.plan(meta, dev), scale)
    assert got.dtype == dtype
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    assert err < RTOL[dtype], err
