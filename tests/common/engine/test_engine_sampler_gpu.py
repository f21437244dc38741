"""The sampler on CUDA draws what it draws on CPU (skipped without a GPU).

The same ops run on both devices; only float rounding (softmax, log) may differ, which can
flip a draw where two candidates are within an ulp, so agreement is asked of almost all.
"""

from __future__ import annotations

import pytest
import torch

from common.engine.sampler import Sampler, SampleRow, position_uniform
from common.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CUDA = torch.device("cuda")


def test_position_hash_is_bit_identical():
    seeds, positions = torch.tensor([0, 7, -(2**63), 2**62]), torch.tensor([0, 1, 99, 2**33])
    cpu = position_uniform(seeds, positions, 4096)
    gpu = position_uniform(seeds.to(CUDA), positions.to(CUDA), 4096)
    assert torch.equal(cpu, gpu.cpu())


def test_seeded_draws_and_masks_agree_between_cpu_and_cuda():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 1000, generator=g) * 3
    kinds = [SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.7, top_k=20, seed=2),
             SamplingParams(temperature=1.2, top_p=0.8, seed=3), SamplingParams(temperature=0),
             SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=4, logprobs=5)]
    rows = [SampleRow(kinds[i % len(kinds)], 100 + i) for i in range(256)]
    cpu = Sampler(torch.device("cpu"))(x, rows)
    gpu = Sampler(CUDA)(x.to(CUDA), rows)
    same = sum(a == b for a, b in zip(cpu.token_ids, gpu.token_ids))
    assert same >= 0.98 * len(rows)
    for i, tok in enumerate(gpu.token_ids):
        p = rows[i].params
        if p.top_k > 0:
            assert tok in set(torch.topk(x[i], p.top_k).indices.tolist())
        if p.greedy:
            assert tok == x[i].argmax().item()
    for a, b in zip(cpu.logprobs, gpu.logprobs):
        assert (a is None) == (b is None)
        if a is not None:
            for tok in set(a) & set(b):
                assert abs(a[tok] - b[tok]) < 1e-3
