"""Sampling settings through the whole engine (tiny random llama)."""

from __future__ import annotations

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams

PROMPT = [5, 17, 99, 3, 42, 8]


def make(checkpoint_dir) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(checkpoint_dir("qwen3")), device="cpu", num_kv_blocks=32))


def test_seed_reproducible_across_batch_mates_and_top_k_1_is_greedy(checkpoint_dir):
    e = make(checkpoint_dir)
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=123, max_tokens=20, ignore_eos=True)
    alone = e.generate([PROMPT], seeded)[0]
    mate = SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True)
    batched = e.generate([[9, 9, 9], PROMPT, [4] * 11], [mate, seeded, mate])[1]
    assert alone == batched
    other = e.generate([PROMPT], SamplingParams(temperature=1.0, seed=124, max_tokens=20, ignore_eos=True))[0]
    assert other != alone
    greedy = e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    top1 = e.generate([PROMPT], SamplingParams(temperature=0.8, top_k=1, max_tokens=20, ignore_eos=True))[0]
    assert greedy == top1


def test_stop_token_ids_max_tokens_and_eos(checkpoint_dir):
    e = make(checkpoint_dir)
    greedy = e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
    assert len(greedy) == 12
    stop_at = greedy[4]
    first = greedy.index(stop_at)
    e.add_request("s", PROMPT, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[stop_at]))
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    assert [t for o in outs for t in o.new_token_ids] == greedy[: first + 1]
    assert outs[-1].finish_reason == "stop" and outs[-1].num_output_tokens == first + 1
    # the same token as eos: stops unless ignore_eos
    e.scheduler.eos_token_ids = {stop_at}
    assert e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0] == greedy[: first + 1]
    assert e.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0] == greedy
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_logprobs_reported_per_token(checkpoint_dir):
    e = make(checkpoint_dir)
    e.add_request("l", PROMPT, SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True))
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    for o in outs:
        for tok, lp in zip(o.new_token_ids, o.new_logprobs):
            assert tok in lp and max(lp.values()) == lp[tok]  # greedy picks the most likely
