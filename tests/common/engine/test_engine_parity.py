"""Greedy tokens must equal transformers' whatever the batching, chunking or preemption."""

from __future__ import annotations

import random

import pytest

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


def prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(n)] for n in lengths]


def engine(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", **kw))


def assert_all_free(e: LLMEngine):
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    assert not e.has_unfinished_requests()


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_greedy_matches_transformers(family, checkpoint_dir, hf_greedy):
    path = checkpoint_dir(family)
    ps = prompts([7, 45, 20], seed=1)
    expected = hf_greedy(path, ps, 32)
    e = engine(path, num_kv_blocks=64)
    # one by one, then all together with a chunked prefill (45 > 16 tokens per step)
    assert [e.generate([p], GREEDY)[0] for p in ps] == expected
    e2 = engine(path, num_kv_blocks=64, max_num_batched_tokens=16)
    assert e2.generate(ps, GREEDY) == expected
    assert_all_free(e)
    assert_all_free(e2)


def test_requests_joining_mid_decode_and_preemption(checkpoint_dir, hf_greedy):
    path = checkpoint_dir("qwen3")
    ps = prompts([41, 3, 17, 60, 9, 28], seed=2)
    expected = hf_greedy(path, ps, 32)
    # 10 blocks of 16 = 160 slots for six requests needing up to 92 each: forces preemption
    e = engine(path, num_kv_blocks=10, max_num_batched_tokens=16)
    got: dict[str, list[int]] = {}
    seqs = []
    for i, p in enumerate(ps[:3]):
        e.add_request(str(i), p, GREEDY)
        seqs.append(e.scheduler.find(str(i)))
    step = 0
    while e.has_unfinished_requests() or step < 10:
        if step in (5, 7, 9):  # join while the first ones are mid-decode
            i = 3 + (step - 5) // 2
            e.add_request(str(i), ps[i], GREEDY)
            seqs.append(e.scheduler.find(str(i)))
        for out in e.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
        step += 1
    assert [got[str(i)] for i in range(6)] == expected
    assert sum(s.num_preemptions for s in seqs) > 0
    assert_all_free(e)


def test_abort_frees_blocks_and_reports(checkpoint_dir):
    e = engine(checkpoint_dir("qwen3"), num_kv_blocks=32)
    e.add_request("a", prompts([30])[0], GREEDY)
    e.add_request("b", prompts([5])[0], GREEDY)
    with pytest.raises(ValueError):
        e.add_request("a", [1, 2], GREEDY)
    with pytest.raises(ValueError):
        e.add_request("c", [1] * e.max_model_len, GREEDY)
    e.step()
    e.abort_request("a")
    outs = {o.request_id: o for o in e.step()}
    assert outs["a"].finished and outs["a"].finish_reason == "abort"
    while e.has_unfinished_requests():
        e.step()
    assert_all_free(e)
