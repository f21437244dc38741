"""Prefix caching in the engine: the same tokens as without it, fewer tokens computed, and
block accounting that holds after every step (no leak, no cached block freed in use)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from helpers.fake_kv_worker import RecordingWorker, consumer, producer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def engine(path, caching: bool, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", enable_prefix_caching=caching, **kw))


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(n)]


def check_blocks(e: LLMEngine) -> None:
    """Each block's ref count is the number of live tables holding it; free means unheld."""
    s, bm = e.scheduler, e.block_manager
    live = [*s.running, *s.waiting, *s.parked.values(), *s.blocks_lent.values()]
    holders = Counter(b for seq in live for b in seq.block_table)
    assert all(bm._ref_counts[b] == holders[b] for b in range(bm.num_blocks))
    free = [*bm._free, *bm._evictable]
    assert len(free) == len(set(free)) and set(free) == {b for b in range(bm.num_blocks) if not holders[b]}
    assert all(bm._cached[h] == b for b, h in bm._hash_of.items())


def run(e: LLMEngine, requests: list[tuple[str, list[int], SamplingParams]],
        preempted: list[int] | None = None) -> dict[str, list[int]]:
    """All requests together, block accounting checked after every step."""
    got: dict[str, list[int]] = {rid: [] for rid, _, _ in requests}
    seqs = []
    for rid, prompt, params in requests:
        e.add_request(rid, prompt, params)
        seqs.append(e.scheduler.find(rid))
    while e.has_unfinished_requests():
        for out in e.step():
            got[out.request_id] += out.new_token_ids
        check_blocks(e)
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
    if preempted is not None:
        preempted.append(sum(s.num_preemptions for s in seqs))
    return got


def chat(e: LLMEngine, params_for, preempted: list[int] | None = None) -> dict[str, list[int]]:
    """Two rounds of four conversations sharing a 40-token system prompt; round two resends
    round one's prompt and answer (the multi-turn pattern), plus one exact repeat."""
    system = tokens(40, 0)
    first = {f"c{i}": system + tokens(5 + 9 * i, i + 1) for i in range(4)}
    out1 = run(e, [(rid, p, params_for(rid)) for rid, p in first.items()], preempted)
    second = [(rid + "-2", first[rid] + out1[rid] + tokens(7, 50 + i), params_for(rid + "-2"))
              for i, rid in enumerate(first)]
    second.append(("c0-again", first["c0"], params_for("c0-again")))
    return {**out1, **run(e, second, preempted)}


SETTINGS = {
    "one step per prompt": dict(num_kv_blocks=64),
    "chunked prefill": dict(num_kv_blocks=64, max_num_batched_tokens=16),
    # 9 blocks of 16 for up to five requests of 60-115 tokens: preemption and eviction
    "preemption": dict(num_kv_blocks=9, max_num_batched_tokens=16),
}


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("sampling", ["greedy", "seeded"])
def test_same_tokens_with_and_without_prefix_caching(setting, sampling, checkpoint_dir):
    path = checkpoint_dir("qwen3")

    def params_for(rid: str) -> SamplingParams:
        if sampling == "greedy":
            return GREEDY
        return SamplingParams(temperature=0.9, top_p=0.95, seed=sum(map(ord, rid)), max_tokens=12,
                              ignore_eos=True)

    cached, preempted = engine(path, True, **SETTINGS[setting]), []
    assert chat(cached, params_for, preempted) == chat(engine(path, False, **SETTINGS[setting]), params_for)
    stats = cached.stats()
    assert stats.prefix_cache_hits >= 32 * 5  # at least the system prompt's 2 full blocks, each of round 2
    if setting == "preemption":
        assert sum(preempted) > 0 and cached.block_manager.num_cached_blocks <= 9


@pytest.mark.parametrize("length, computed", [(33, 1), (32, 16), (20, 4)])
def test_a_cached_prompt_still_computes_its_last_token(length, computed, checkpoint_dir):
    e = engine(checkpoint_dir("qwen3"), True, num_kv_blocks=16)
    prompt = tokens(length, 7)
    [expected] = e.generate([prompt], GREEDY)
    e.add_request("again", prompt, GREEDY)
    got = [t for o in e.step() for t in o.new_token_ids]
    assert e.last_step_num_tokens == computed  # the last prompt token is always computed (logits)
    while e.has_unfinished_requests():
        got += [t for o in e.step() for t in o.new_token_ids]
    assert got == expected
    stats = e.stats()
    assert stats.prefix_cache_queries == 2 * length and stats.prefix_cache_hits == length - computed


def test_disabled_caches_nothing(checkpoint_dir):
    e = engine(checkpoint_dir("qwen3"), False, num_kv_blocks=16)
    prompt = tokens(33, 7)
    e.generate([prompt, prompt], GREEDY)
    e.add_request("again", prompt, GREEDY)
    e.step()
    assert e.last_step_num_tokens == 33
    assert e.stats().prefix_cache_queries == 0 and e.block_manager.num_cached_blocks == 0



def test_decode_side_asks_only_for_the_blocks_it_lacks(checkpoint_dir):
    """A producer engine computes each prompt; the test copies only the blocks the consumer
    asked for, as the transfer does. Tokens equal a colocated run; a repeat, all but one block
    cached, asks for nothing: the decode side computes that block itself (the override)."""
    path = checkpoint_dir("qwen3")
    first_prompt = tokens(70, 3)  # 5 blocks: 4 full + 6 tokens
    second_prompt = first_prompt[:64] + tokens(30, 4)  # shares the 4 full blocks: 6 blocks
    expected = engine(path, False, num_kv_blocks=32).generate([first_prompt, second_prompt], GREEDY)
    p = LLMEngine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32), producer())
    dw = RecordingWorker()
    d = LLMEngine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32), consumer(dw))
    cases = (("a", first_prompt, 0, expected[0]), ("b", second_prompt, 4, expected[1]),
             ("c", second_prompt, None, expected[1]))
    for rid, prompt, want_first, want in cases:
        p.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1),
                      kv_transfer_params={"decode_addr": "127.0.0.1:1"})
        [first_token] = [t for o in p.step() for t in o.new_token_ids]
        p_table = p.scheduler.blocks_lent[rid].block_table
        d.add_request(rid, prompt, GREEDY, kv_transfer_params={"prefill_addr": "127.0.0.1:2"})
        got = [t for o in d.step() for t in o.new_token_ids]
        if want_first is None:
            assert rid not in dw.loads and got  # computed here: its first token is out already
        else:
            first, blocks = dw.loads[rid]
            assert first == want_first and len(blocks) == len(p_table) - first
            for src, dst in zip(p.kv_caches, d.kv_caches):
                dst[:, blocks] = src[:, p_table[first:]]
            dw.land(rid, first_token)
        while d.has_unfinished_requests():
            got += [t for o in d.step() for t in o.new_token_ids]
            check_blocks(d)
        assert got == want
    assert d.stats().prefix_cache_hits == 64 + 80
    assert p.stats().prefix_cache_hits == 64 + 80  # the producer computed only what it lacked


def test_a_request_that_cannot_get_blocks_gives_its_cached_ones_back(checkpoint_dir):
    e = engine(checkpoint_dir("qwen3"), True, num_kv_blocks=6)
    prompt = tokens(40, 9)  # 3 blocks, 2 full ones cached after the run
    e.generate([prompt], GREEDY)
    e.add_request("big", tokens(70, 10), GREEDY)  # 5 blocks + growth: holds most of the cache
    e.step()
    e.add_request("again", prompt, GREEDY)  # 2 cached blocks + 1 new: no block free for it yet
    for _ in range(3):
        e.step()
        check_blocks(e)
    while e.has_unfinished_requests():
        e.step()
        check_blocks(e)
    assert e.block_manager.num_free_blocks == 6
