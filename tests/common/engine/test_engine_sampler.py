from __future__ import annotations

import torch

from common.engine.sampler import Sampler
from common.engine.sampling_params import SamplingParams


def logits(rows=4, vocab=50, seed=1):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def test_greedy_and_top_k_1_are_argmax():
    x = logits()
    s = Sampler(torch.device("cpu"))
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=1)] * 2
    out = s(x, params, [None] * 4)
    assert out.token_ids == x.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_seeded_rows_ignore_batch_mates():
    x = logits(rows=3)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=7)
    s = Sampler(torch.device("cpu"))

    def draw(rows, params):
        gens = [torch.Generator().manual_seed(q.seed) if q.seed is not None else None for q in params]
        return [s(x[rows], params, gens).token_ids for _ in range(1)][0]

    alone = [s(x[0:1], [p], [torch.Generator().manual_seed(7)]).token_ids[0] for _ in range(1)]
    gen = torch.Generator().manual_seed(7)
    seq_alone = [s(x[0:1], [p], [gen]).token_ids[0] for _ in range(20)]
    gen = torch.Generator().manual_seed(7)
    mates = SamplingParams(temperature=1.0)
    seq_batched = [s(x, [p, mates, mates], [gen, None, None]).token_ids[0] for _ in range(20)]
    assert seq_alone == seq_batched and seq_alone[0] == alone[0]
    assert len(set(seq_alone)) > 1  # it really samples
    assert draw([0, 1], [p, mates])[0] == alone[0]


def test_top_p_keeps_only_the_nucleus():
    x = torch.tensor([[5.0, 4.9, -10.0, -10.0]])
    s = Sampler(torch.device("cpu"))
    seen = {s(x, [SamplingParams(temperature=1.0, top_p=0.5)], [None]).token_ids[0] for _ in range(50)}
    assert seen == {0}
    seen = {s(x, [SamplingParams(temperature=1.0, top_p=0.99)], [None]).token_ids[0] for _ in range(50)}
    assert seen == {0, 1}


def test_logprobs_top_n_and_chosen():
    x = logits(rows=2)
    s = Sampler(torch.device("cpu"))
    out = s(x, [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0, logprobs=0)], [None, None])
    ref = torch.log_softmax(x, -1)
    top = torch.topk(ref[0], 3)
    assert list(out.logprobs[0]) == top.indices.tolist()
    assert abs(out.logprobs[0][top.indices[0].item()] - top.values[0].item()) < 1e-6
    assert list(out.logprobs[1]) == [out.token_ids[1]]
