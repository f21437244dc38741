"""Sampling through the whole engine (tiny random Qwen3): seeded draws are fixed by position,
so a request split after its first token (prefill here, decode elsewhere) continues the same
stream; min_tokens holds EOS off."""

from __future__ import annotations

from test_engine_sampling_e2e import PROMPT, make

from common.engine.sampling_params import SamplingParams


def test_seeded_stream_continues_across_a_split(checkpoint_dir):
    e = make(checkpoint_dir)
    seeded = SamplingParams(temperature=1.0, top_k=50, seed=42, max_tokens=12, ignore_eos=True)
    whole = e.generate([PROMPT], seeded)[0]
    first = e.generate([PROMPT], SamplingParams(temperature=1.0, top_k=50, seed=42, max_tokens=1))[0]
    rest = SamplingParams(temperature=1.0, top_k=50, seed=42, max_tokens=11, ignore_eos=True)
    assert first + e.generate([PROMPT + first], rest)[0] == whole
    assert len(set(whole)) > 3


def test_min_tokens_holds_eos_off(checkpoint_dir):
    e = make(checkpoint_dir)
    greedy = e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    e.scheduler.eos_token_ids = {greedy[0]}  # the first greedy token is EOS for this test
    e.runner.sampler.eos_token_ids = frozenset({greedy[0]})
    assert e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8))[0] == greedy[:1]
    held = e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, min_tokens=3))[0]
    assert greedy[0] not in held[:3] and len(held) >= 3
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
