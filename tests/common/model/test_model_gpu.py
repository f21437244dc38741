"""On a GPU the same model runs in bfloat16 and stays close to the float32 CPU result."""

from __future__ import annotations

import pytest
import torch

from common.model.loader import load_model
from helpers.hf_checkpoints import make_checkpoint
from helpers.paged_cache import PagedCache

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_bf16_cuda_close_to_fp32_cpu(tmp_path, family):
    path = make_checkpoint(tmp_path, family)
    outputs = []
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        model, _ = load_model(path, device=device, dtype=dtype)
        cache = PagedCache(model, num_blocks=32, block_size=16)
        seqs = [cache.new_seq(list(range(3, 3 + n))) for n in (40, 25)]
        with torch.inference_mode():
            cache.step([(seqs[0], 30), (seqs[1], 21)])
            cache.step([(seqs[1], 1), (seqs[0], 10)])  # a decode batched with a continuing chunk
            for _ in range(3):
                cache.step([(seqs[1], 1)])
        outputs.append(torch.cat([torch.stack(s.outputs) for s in seqs]).cpu())
    ref, got = outputs
    err = ((got - ref).abs().max() / ref.abs().max()).item()
    assert err < 5e-2, err
