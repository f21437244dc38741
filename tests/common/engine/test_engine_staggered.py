"""Continuous batching must not change any result: requests arriving at random steps,
mixing chunked prefills and decodes of other requests in every batch, produce exactly
the tokens each request produces alone (embedded model, greedy)."""

from __future__ import annotations

import random

import pytest

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(max_num_batched_tokens=48))


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(4, 2048) for _ in range(rng.randrange(3, 200))] for _ in range(20)]


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=15, ignore_eos=True)


def _staggered(engine: LLMEngine, prompts: list[list[int]], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    pending, out = list(range(len(prompts))), {}
    while pending or engine.has_unfinished_requests():
        while pending and rng.random() < 0.5:  # a random number of arrivals before each step
            i = pending.pop(0)
            engine.add_request(f"stagger-{seed}-{i}", prompts[i], _greedy())
            out[i] = []
        for o in engine.step():
            out[int(o.request_id.rsplit("-", 1)[1])] += o.new_token_ids
    return [out[i] for i in range(len(prompts))]


def test_staggered_arrivals_match_each_request_alone(engine: LLMEngine) -> None:
    prompts = _prompts()
    alone = [engine.generate([p], _greedy())[0] for p in prompts]
    for seed in range(4):
        assert _staggered(engine, prompts, seed) == alone, f"arrival pattern {seed}"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
