"""vLLM's sampling fields in the batched sampler against transformers' logits processors, on the
embedded model's own logits: each field alone per row, all rows of a batch processed together
(rows without the field left untouched), and greedy picks that obey the processed logits."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_checkpoints import load_hf_model
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TopKLogitsWarper,
)

from common.engine.logits_processors import (
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
)
from common.engine.sampler import Sampler, SampleRow, _top_k_mask
from common.engine.sampling_params import SamplingParams
from common.model.embedded import EOS, ensure_embedded_model

CPU = torch.device("cpu")
PROMPTS = [[5, 17, 99, 3, 42, 8, 17, 17], [300, 301, 302, 300], [7] * 5, [1000, 20, 5, 2000, 20]]
OUTPUTS = [[17, 44, 44, 5], [], [7, 7, 9], [20]]


@pytest.fixture(scope="module")
def model_logits() -> torch.Tensor:
    """The embedded model's next-token logits after each prompt + output, ``[4, 2048]``."""
    model = load_hf_model(ensure_embedded_model())
    with torch.no_grad():
        return torch.stack([model(torch.tensor([p + o])).logits[0, -1] for p, o in zip(PROMPTS, OUTPUTS)])


def rows(params: list[SamplingParams]) -> list[SampleRow]:
    return [SampleRow(p, len(pr) + len(o), len(o), None, pr, o) for p, pr, o in zip(params, PROMPTS, OUTPUTS)]


def to_device(columns: list[list], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(columns, dtype=dtype)


def ids(i: int) -> torch.Tensor:
    return torch.tensor([PROMPTS[i] + OUTPUTS[i]])


def test_repetition_penalty_matches_transformers_over_prompt_and_output(model_logits: torch.Tensor) -> None:
    penalties = [1.3, 1.0, 0.7, 2.0]  # row 1 has none: it stays the model's
    got = apply_penalties(model_logits, rows([SamplingParams(repetition_penalty=p) for p in penalties]), to_device)
    for i, p in enumerate(penalties):
        want = RepetitionPenaltyLogitsProcessor(p)(ids(i), model_logits[i : i + 1].clone())[0]
        torch.testing.assert_close(got[i], want, rtol=0, atol=0)
    assert not torch.equal(got[0], model_logits[0])


def test_presence_and_frequency_penalties_are_openais(model_logits: torch.Tensor) -> None:
    """``logit - frequency * count - presence * (count > 0)`` over the output tokens only."""
    settings = [(0.5, 0.0), (1.0, 1.0), (-1.5, 0.3), (0.0, 2.0)]
    params = [SamplingParams(presence_penalty=p, frequency_penalty=f) for p, f in settings]
    got = apply_penalties(model_logits, rows(params), to_device)
    for i, (presence, frequency) in enumerate(settings):
        counts = torch.bincount(torch.tensor(OUTPUTS[i], dtype=torch.long), minlength=2048).float()
        want = model_logits[i] - frequency * counts - presence * (counts > 0).float()
        torch.testing.assert_close(got[i], want)
    assert got[0, 99] == model_logits[0, 99]  # a prompt token: presence/frequency count the output only


def test_logit_bias_matches_transformers_sequence_bias(model_logits: torch.Tensor) -> None:
    biases = [{5: 10.0, 17: -100.0}, {}, {0: 100.0, 2047: -3.5}, {20: 0.25}]
    got = apply_logit_bias(model_logits, rows([SamplingParams(logit_bias=b) for b in biases]), to_device)
    for i, bias in enumerate(biases):
        want = model_logits[i : i + 1].clone()
        if bias:
            want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias.items()})(ids(i), want)
        torch.testing.assert_close(got[i], want[0])


def test_min_p_matches_transformers(model_logits: torch.Tensor) -> None:
    min_ps = [0.05, 0.0, 0.5, 1.0]
    scaled = model_logits / 0.7
    got = apply_min_p(scaled, rows([SamplingParams(min_p=m) for m in min_ps]), to_device)
    for i, m in enumerate(min_ps):
        want = MinPLogitsWarper(m)(ids(i), scaled[i : i + 1].clone())[0] if m else scaled[i]
        torch.testing.assert_close(got[i], want)
    assert (got[3] > float("-inf")).sum() == 1  # min_p 1 keeps only the most likely token


def test_top_k_matches_transformers(model_logits: torch.Tensor) -> None:
    top_ks = [1, 0, 40, 2048]
    got = _top_k_mask(model_logits, torch.tensor(top_ks), max(top_ks))
    for i, k in enumerate(top_ks):
        want = TopKLogitsWarper(k)(ids(i), model_logits[i : i + 1].clone())[0] if k else model_logits[i]
        torch.testing.assert_close(got[i], want)


def test_min_tokens_masks_eos_and_stop_ids_as_transformers(model_logits: torch.Tensor) -> None:
    """Greedy rows whose top token is EOS / a stop id: held off until min_tokens are generated."""
    forced = model_logits.clone()
    forced[:, EOS] += 100.0
    forced[3, 9] += 200.0  # row 3's stop id is more likely still
    params = [SamplingParams(temperature=0, min_tokens=6), SamplingParams(temperature=0, min_tokens=0),
              SamplingParams(temperature=0, min_tokens=3), SamplingParams(temperature=0, min_tokens=2,
                                                                          stop_token_ids=[9])]
    got = Sampler(CPU, eos_token_ids=[EOS])(forced, rows(params)).token_ids
    for i, p in enumerate(params):
        stops = [EOS, *p.stop_token_ids]
        processor = MinNewTokensLengthLogitsProcessor(len(PROMPTS[i]), p.min_tokens, stops)
        assert got[i] == int(processor(ids(i), forced[i : i + 1].clone()).argmax())
    assert got[1] == EOS and got[2] == EOS and got[0] != EOS and got[3] not in (EOS, 9)


def test_greedy_picks_obey_every_field_at_once(model_logits: torch.Tensor) -> None:
    """The sampler's greedy token is the argmax after bias and penalties, for every row of the
    batch together; the logprobs stay the model's raw ones."""
    top = model_logits.argmax(dim=-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={top[0]: -100.0}, logprobs=0),
              SamplingParams(temperature=0, repetition_penalty=5.0),
              SamplingParams(temperature=0, frequency_penalty=2.0, presence_penalty=2.0),
              SamplingParams(temperature=0)]
    out = Sampler(CPU)(model_logits, rows(params))
    processed = apply_penalties(apply_logit_bias(model_logits, rows(params), to_device), rows(params), to_device)
    assert out.token_ids == processed.argmax(dim=-1).tolist()
    assert out.token_ids[0] != top[0] and out.token_ids[3] == top[3]
    raw = torch.log_softmax(model_logits[0], dim=-1)[out.token_ids[0]].item()
    assert out.logprobs[0] == {out.token_ids[0]: pytest.approx(raw)}


def test_resumed_tokens_count_as_output() -> None:
    """A migrated request's prompt ends with its own output: penalized as the undisturbed run was."""
    x = torch.zeros(1, 16)
    whole = SampleRow(SamplingParams(frequency_penalty=1.0), 6, 2, None, [1, 2, 3, 4], [5, 5])
    resumed = SampleRow(SamplingParams(frequency_penalty=1.0, resumed_tokens=1), 6, 1, None, [1, 2, 3, 4, 5], [5])
    torch.testing.assert_close(apply_penalties(x, [whole], to_device), apply_penalties(x, [resumed], to_device))
    assert apply_penalties(x, [whole], to_device)[0, 5] == -2.0
