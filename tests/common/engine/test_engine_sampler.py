"""The batched sampler on CPU: masks, distributions, seeded draws by position, min_tokens, logprobs."""

from __future__ import annotations

import pytest
import torch

from common.engine.sampler import Sampler, SampleRow, position_uniform
from common.engine.sampling_params import SamplingParams

CPU = torch.device("cpu")


def logits(rows: int = 4, vocab: int = 50, seed: int = 1) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed))


def rows_of(params: list[SamplingParams], position: int = 10, generated: int = 0) -> list[SampleRow]:
    return [SampleRow(p, position, generated) for p in params]


def draws(x: torch.Tensor, p: SamplingParams, positions: range, sampler: Sampler | None = None) -> list[int]:
    """One token per position for a single-row ``x`` (a seeded row's stream over a sequence)."""
    s = sampler or Sampler(CPU)
    return [s(x, [SampleRow(p, pos)]).token_ids[0] for pos in positions]


def test_greedy_and_top_k_1_are_argmax_without_logprobs():
    x = logits()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.5, top_k=1)] * 2
    out = Sampler(CPU)(x, rows_of(params))
    assert out.token_ids == x.argmax(-1).tolist()
    assert out.logprobs == [None] * 4


def test_temperature_towards_zero_equals_greedy():
    x = logits(rows=64, vocab=300, seed=5)
    params = [SamplingParams(temperature=1e-4, seed=i if i % 2 else None) for i in range(64)]
    assert Sampler(CPU)(x, rows_of(params)).token_ids == x.argmax(-1).tolist()


def test_seeded_draw_is_a_function_of_seed_and_position_only():
    x = logits(rows=1, vocab=40)
    p = SamplingParams(temperature=1.0, seed=7)
    first = draws(x, p, range(100, 140))
    # another sampler, whose shared generator has been used: same stream
    used = Sampler(CPU, seed=99)
    used(x, rows_of([SamplingParams(temperature=1.0)]))
    assert draws(x, p, range(100, 140), used) == first
    assert len(set(first)) > 5  # it really samples
    assert draws(x, p, range(101, 141)) != first  # the position moves the stream
    assert draws(x, SamplingParams(temperature=1.0, seed=8), range(100, 140)) != first
    # any Python int is a seed: negative and beyond 64 bits wrap, they do not fail
    assert len(draws(x, SamplingParams(temperature=1.0, seed=-(2**70)), range(3))) == 3


def test_seeded_rows_ignore_batch_mates():
    x = logits(rows=6, vocab=80, seed=3)
    p = SamplingParams(temperature=1.0, top_p=0.9, top_k=20, seed=7)
    s = Sampler(CPU)
    alone = [s(x[2:3], [SampleRow(p, pos)]).token_ids[0] for pos in range(30)]
    mates = [SamplingParams(temperature=1.0), SamplingParams(temperature=0),
             SamplingParams(temperature=0.5, seed=1), SamplingParams(temperature=1.3, top_k=3),
             SamplingParams(temperature=0.7, top_p=0.5)]
    batched = []
    for pos in range(30):
        params = mates[:2] + [p] + mates[2:]
        rows = [SampleRow(q, pos + 5 * i) for i, q in enumerate(params)]
        rows[2] = SampleRow(p, pos)
        batched.append(s(x, rows).token_ids[2])
    assert batched == alone


def test_top_k_mask_is_respected_and_its_tokens_all_drawn():
    x = logits(rows=1, vocab=60, seed=11)
    allowed = set(torch.topk(x[0], 5).indices.tolist())
    for p in (SamplingParams(temperature=1.0, top_k=5, seed=3), SamplingParams(temperature=1.0, top_k=5)):
        seen = set(draws(x, p, range(600)))
        assert seen == allowed


def test_top_p_keeps_only_the_nucleus():
    x = torch.tensor([[5.0, 4.9, -10.0, -10.0]])
    assert set(draws(x, SamplingParams(temperature=1.0, top_p=0.5, seed=1), range(60))) == {0}
    assert set(draws(x, SamplingParams(temperature=1.0, top_p=0.99), range(60))) == {0, 1}
    # a batch mixing rows with and without top-p: each row keeps its own nucleus
    both = torch.cat([x, x])
    s = Sampler(CPU)
    params = [SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, top_p=1.0, seed=4)]
    seen = [set(), set()]
    for pos in range(200):
        for i, t in enumerate(s(both, rows_of(params, pos)).token_ids):
            seen[i].add(t)
    assert seen[0] == {0} and seen[1] == {0, 1}


@pytest.mark.parametrize("seed", [None, 1234])
def test_draws_follow_the_tempered_distribution(seed: int | None):
    x = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    temperature = 0.8
    expected = torch.softmax(x[0] / temperature, -1)
    s = Sampler(CPU)
    rows = [SampleRow(SamplingParams(temperature=temperature, seed=seed), pos) for pos in range(4000)]
    got = s(x.expand(len(rows), -1), rows).token_ids
    freq = torch.bincount(torch.tensor(got), minlength=6).float() / len(got)
    assert (freq - expected).abs().max() < 0.03, (freq, expected)


def test_position_uniform_is_uniform_and_open():
    u = position_uniform(torch.tensor([5, -9]), torch.tensor([0, 2**40]), 50_000)
    assert u.min() > 0 and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.01
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max() < 0.01


def test_min_tokens_masks_eos_and_stop_ids_until_reached():
    x = torch.tensor([[9.0, 8.0, 0.0, 0.0]])  # token 0 (eos) then 1 (a stop id) dominate
    s = Sampler(CPU, eos_token_ids=[0])
    p = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1])
    assert s(x, [SampleRow(p, 5, 0)]).token_ids[0] not in (0, 1)
    assert s(x, [SampleRow(p, 6, 1)]).token_ids[0] not in (0, 1)
    assert s(x, [SampleRow(p, 7, 2)]).token_ids == [0]  # reached: eos allowed again
    ignoring = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1], ignore_eos=True)
    assert s(x, [SampleRow(ignoring, 5, 0)]).token_ids == [0]  # eos is not a stop: not masked
    sampled = SamplingParams(temperature=1.0, min_tokens=1, seed=2)
    assert 0 not in [s(x, [SampleRow(sampled, pos, 0)]).token_ids[0] for pos in range(50)]


def test_min_tokens_is_validated():
    from common.engine.sampling_params import SamplingParamsError

    for bad in (-1, 17):
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(max_tokens=16, min_tokens=bad).validate()
        assert err.value.param == "min_tokens"
    SamplingParams(max_tokens=16, min_tokens=16).validate()


def test_logprobs_are_raw_log_softmax_for_rows_that_asked():
    x = logits(rows=3)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.7, seed=5),
              SamplingParams(temperature=1.0, logprobs=0, seed=9)]
    out = Sampler(CPU)(x, rows_of(params))
    ref = torch.log_softmax(x, -1)
    top = torch.topk(ref[0], 3)
    assert list(out.logprobs[0]) == top.indices.tolist()
    for tok, lp in out.logprobs[0].items():
        assert abs(lp - ref[0, tok].item()) < 1e-6
    assert out.logprobs[1] is None
    assert list(out.logprobs[2]) == [out.token_ids[2]]
    assert abs(out.logprobs[2][out.token_ids[2]] - ref[2, out.token_ids[2]].item()) < 1e-6


def test_chosen_token_outside_top_n_is_reported_too():
    x = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    p = SamplingParams(temperature=0, logprobs=1, min_tokens=1, stop_token_ids=[0])
    out = Sampler(CPU)(x, [SampleRow(p, 0)])
    assert out.token_ids == [1]
    ref = torch.log_softmax(x[0], -1)  # raw logprobs: the mask does not change them
    assert out.logprobs[0] == pytest.approx({0: ref[0].item(), 1: ref[1].item()})
