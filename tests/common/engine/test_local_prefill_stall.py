"""``max_local_prefill_stall_ms``: a prompt prefilled beside running decodes is chunked so that
no step carrying a decode also carries more prompt tokens than the bound allows at the measured
prefill rate. Checked on the engine's step records (what the scheduler did), not on wall time;
the tokens are the same as without the bound (greedy, embedded model)."""

from __future__ import annotations

import random

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams

BOUND_MS = 2.0  # small enough that the long prompt below cannot go in one step beside a decode


def _run(engine: LLMEngine, long_prompt: list[int]) -> dict[str, list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out: dict[str, list[int]] = {"decoding": [], "long": []}
    engine.add_request("warm", long_prompt[:100], SamplingParams(temperature=0, max_tokens=1))  # a timed prefill
    while engine.has_unfinished_requests():
        engine.step()
    engine.add_request("decoding", long_prompt[:20], greedy)
    while len(out["decoding"]) < 3:  # it is decoding before the long prompt arrives
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    engine.add_request("long", long_prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return out


def test_a_local_prefill_beside_decodes_is_chunked_within_the_bound() -> None:
    prompt = [random.Random(3).randrange(4, 2048) for _ in range(700)]
    config = dict(max_num_batched_tokens=512, enable_prefix_caching=False, num_kv_blocks=256)
    bounded = LLMEngine(EngineConfig(max_local_prefill_stall_ms=BOUND_MS, **config))
    got = _run(bounded, prompt)

    mixed = [r for r in bounded.step_meter.records if r.num_decode_rows and r.num_prefill_tokens]
    assert len(mixed) >= 2, "the long prompt was not chunked beside the decode"
    for r in mixed:
        assert r.prefill_tokens_per_s is not None and r.prefill_token_cap is not None
        assert r.prefill_token_cap == max(16, int(r.prefill_tokens_per_s * BOUND_MS / 1000))
        assert r.num_prefill_tokens <= r.prefill_token_cap
    assert sum(r.num_prefill_tokens for r in mixed) <= len(prompt)

    unbounded = LLMEngine(EngineConfig(**config))
    assert _run(unbounded, prompt) == got  # chunking changes when, never what
    assert all(r.prefill_token_cap is None for r in unbounded.step_meter.records)


def test_without_decodes_a_prompt_takes_the_whole_step_budget() -> None:
    engine = LLMEngine(EngineConfig(max_local_prefill_stall_ms=BOUND_MS, max_num_batched_tokens=256,
                                    num_kv_blocks=128))
    engine.add_request("a", list(range(4, 604)), SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    prompt_steps = [r.num_prefill_tokens for r in engine.step_meter.records]
    assert prompt_steps == [256, 256, 88]  # nothing decodes: the bound does not apply
    assert engine.stats().prefill_tokens_per_s is not None
