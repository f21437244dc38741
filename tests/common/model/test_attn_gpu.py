"""On CUDA: the compiled Triton kernel against SDPA, and our bf16 model against transformers bf16.

Tolerances: bf16 keeps 8 bits of mantissa, so two correct bf16 attention implementations
differ by ~1e-2 relative; whole-model logits over 2 layers by up to ~5e-2 of their range.
"""

from __future__ import annotations

import pytest
import torch

from common.model.attn_backends.sdpa import SdpaBackend
from common.model.loader import load_model
from helpers.hf_checkpoints import load_hf_model, make_checkpoint
from helpers.paged_cache import PagedCache
from helpers.random_paged import random_step

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
triton_paged = pytest.importorskip("common.model.attn_backends.triton_paged")

ATTN_RTOL = 2e-2  # bf16 attention, kernel vs SDPA
LOGITS_RTOL = 5e-2  # bf16 model logits vs transformers bf16, relative to the largest logit


@pytest.mark.parametrize(("query_lens", "seq_lens"), [
    ([1] * 64, [1 + 37 * i for i in range(64)]),  # decode
    ([300, 7, 1], [300, 7, 1]),  # varlen prefill
    ([1, 200, 1, 33], [2048, 900, 17, 60]),  # mixed, chunks over context
])
def test_compiled_kernel_matches_sdpa_bf16(query_lens, seq_lens):
    cache, k, v, meta, g = random_step(query_lens, seq_lens, 8, 128, 16)
    q = torch.randn(sum(query_lens), 32, 128, generator=g)
    dev = torch.device("cuda")
    cache, k, v, q = (t.to(dev, torch.bfloat16) for t in (cache, k, v, q))
    meta.slot_mapping, meta.block_tables = meta.slot_mapping.to(dev), meta.block_tables.to(dev)
    sdpa, tri = SdpaBackend(), triton_paged.TritonBackend()
    want = sdpa.forward(q, k, v, cache, sdpa.plan(meta, dev), 128**-0.5).float()
    got = tri.forward(q, k, v, cache, tri.plan(meta, dev), 128**-0.5).float()
    assert ((got - want).abs().max() / want.abs().max()).item() < ATTN_RTOL


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_triton_model_logits_and_greedy_match_transformers_bf16(tmp_path, family):
    path = make_checkpoint(tmp_path, family)
    ours, _ = load_model(path, device="cuda", dtype=torch.bfloat16)
    ours.attn_backend = triton_paged.TritonBackend()
    hf = load_hf_model(path).to("cuda", torch.bfloat16)
    ids = list(range(3, 3 + 60))
    cache = PagedCache(ours, num_blocks=32, block_size=16)
    seq = cache.new_seq(ids)
    with torch.inference_mode():
        cache.step([(seq, 40)])  # prefill, then a chunk over context, then decode
        cache.step([(seq, 12)])
        for _ in range(8):
            cache.step([(seq, 1)])
        ref = hf(torch.tensor([ids], device="cuda")).logits[0].float().cpu()
    got = torch.stack(seq.outputs).float()
    assert ((got - ref).abs().max() / ref.abs().max()).item() < LOGITS_RTOL
    agree = (got.argmax(-1) == ref.argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


def test_fused_layer_ops_on_cuda_match_cpu_float32():
    """RMSNorm, rotary and the gated MLP take the fused kernels on CUDA; CPU float32 is the reference."""
    from common.model.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary

    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 4, 64, generator=g)
    norm, mlp = RMSNorm(64, 1e-6), GatedMLP(64, 200)
    norm.weight.data = torch.randn(64, generator=g)
    rope = RotaryEmbedding(64, 128, 10000.0, None)
    positions = torch.arange(9) * 7
    cos, sin = rope(positions)
    want = [norm(x), apply_rotary(x, cos, sin), mlp(x[:, 0])]
    rope.reset_table(torch.device("cuda"))
    cos, sin = rope(positions.cuda())
    norm, mlp = norm.to("cuda", torch.bfloat16), mlp.to("cuda", torch.bfloat16)
    xc = x.to("cuda", torch.bfloat16)
    got = [norm(xc), apply_rotary(xc, cos, sin), mlp(xc[:, 0])]
    for a, b in zip(got, want):
        assert ((a.float().cpu() - b).abs().max() / b.abs().max()).item() < ATTN_RTOL
