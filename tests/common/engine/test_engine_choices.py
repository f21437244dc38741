"""``n`` > 1 in the engine: one prompt pass, then the choices fork with the prompt's full blocks
shared (ref-counted) and the tail block copied; every block is freed exactly once whether the
choices finish or are aborted, and each choice answers as its own seeded n=1 request would."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from common.engine.choices import choice_request_id
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams, choice_seed
from helpers.fake_kv_worker import RecordingWorker, consumer, producer
from test_prefix_cache_engine import check_blocks, engine, tokens

SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True)


def run_all(e: LLMEngine, outs: list | None = None) -> dict[tuple[str, int], list[int]]:
    """Step until nothing is left; tokens per (request id, choice index) (``outs``: those of steps
    already taken), blocks checked each step."""
    got: dict[tuple[str, int], list[int]] = {}
    outs = list(outs or [])
    while outs or e.has_unfinished_requests():
        for out in outs or e.step():
            got.setdefault((out.request_id, out.index), []).extend(out.new_token_ids)
        outs = []
        check_blocks(e)
    return got


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("prompt_len", [70, 64])  # a partial tail block (copied) / only full blocks
def test_choices_share_the_prompt_and_free_every_block(checkpoint_dir, caching, prompt_len):
    e = engine(checkpoint_dir("qwen3"), caching, num_kv_blocks=40)
    start = e.block_manager.num_free_blocks
    prompt = tokens(prompt_len, 3)
    e.add_request("r", prompt, replace(SEEDED, n=4))
    first = e.step()  # the prompt pass: four first tokens, then the fork
    seqs = [e._requests[choice_request_id("r", i)] for i in range(4)]
    num_full = prompt_len // e.block_manager.block_size
    for seq in seqs[1:]:
        assert seq.block_table[:num_full] == seqs[0].block_table[:num_full]
    assert all(e.block_manager._ref_counts[b] == 4 for b in seqs[0].block_table[:num_full])
    tails = {tuple(s.block_table[num_full:]) for s in seqs}
    assert len(tails) == (4 if prompt_len % 16 else 1)  # each choice writes its own tail block
    got = run_all(e, first)
    assert sorted(got) == [("r", i) for i in range(4)] and all(len(t) == 8 for t in got.values())
    assert e.block_manager.num_free_blocks == start


def test_each_choice_is_its_own_seeded_request(checkpoint_dir):
    """Choice i draws as an n=1 request seeded with ``choice_seed(seed, i)`` (choice 0: the seed),
    so any node computes the same answer."""
    e = engine(checkpoint_dir("qwen3"), False, num_kv_blocks=40)
    prompt = tokens(37, 5)
    e.add_request("r", prompt, replace(SEEDED, n=4))
    got = run_all(e)
    alone = e.generate([prompt] * 4, [replace(SEEDED, seed=SEEDED.seed if i == 0 else choice_seed(7, i))
                                      for i in range(4)])
    assert [got[("r", i)] for i in range(4)] == alone
    assert len({tuple(t) for t in alone}) > 1  # the seeds differ, so do the choices


def test_greedy_choices_equal_n1(checkpoint_dir):
    e = engine(checkpoint_dir("qwen3"), True, num_kv_blocks=40)
    prompt = tokens(45, 8)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    e.add_request("r", prompt, replace(greedy, n=3))
    got = run_all(e)
    (alone,) = e.generate([prompt], greedy)
    assert [got[("r", i)] for i in range(3)] == [alone] * 3


def test_logprobs_per_choice(checkpoint_dir):
    e = engine(checkpoint_dir("qwen3"), False, num_kv_blocks=40)
    e.add_request("r", tokens(20, 1), replace(SEEDED, n=2, logprobs=2, max_tokens=3))
    outs = []
    while e.has_unfinished_requests():
        outs += e.step()
    for index in (0, 1):
        mine = [o for o in outs if o.index == index]
        ids = [t for o in mine for t in o.new_token_ids]
        lps = [lp for o in mine for lp in o.new_logprobs]
        assert len(lps) == len(ids) == 3 and all(t in lp for t, lp in zip(ids, lps))


@pytest.mark.parametrize("whole", [True, False])
def test_abort_frees_every_block_once(checkpoint_dir, whole):
    e = engine(checkpoint_dir("qwen3"), True, num_kv_blocks=40)
    start = e.block_manager.num_free_blocks
    e.add_request("r", tokens(50, 2), replace(SEEDED, n=4, max_tokens=30))
    for _ in range(3):
        e.step()
        check_blocks(e)
    e.abort_request("r", None if whole else 2)
    got: dict[int, list[str]] = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                got.setdefault(out.index, []).append(out.finish_reason)
        check_blocks(e)
    if whole:
        assert got == {i: ["abort"] for i in range(4)}
    else:
        assert got == {0: ["length"], 1: ["length"], 2: ["abort"], 3: ["length"]}
    assert e.block_manager.num_free_blocks == start


def test_abort_before_the_fork_leaves_no_choice(checkpoint_dir):
    e = engine(checkpoint_dir("qwen3"), True, num_kv_blocks=40, max_num_batched_tokens=16)
    start = e.block_manager.num_free_blocks
    e.add_request("r", tokens(50, 2), replace(SEEDED, n=4))
    e.step()  # a chunk of the prompt: nothing sampled yet
    e.abort_request("r")
    assert [(o.index, o.finish_reason) for o in e.step()] == [(0, "abort")]
    assert not e.has_unfinished_requests() and e.block_manager.num_free_blocks == start


def test_one_token_choices_hold_no_blocks(checkpoint_dir):
    e = engine(checkpoint_dir("qwen3"), False, num_kv_blocks=40)
    start = e.block_manager.num_free_blocks
    e.add_request("r", tokens(30, 4), replace(SEEDED, n=4, max_tokens=1))
    outs = e.step()
    assert sorted((o.index, o.finished, o.finish_reason) for o in outs) == [(i, True, "length") for i in range(4)]
    assert not e.scheduler.block_copies and e.block_manager.num_free_blocks == start


def test_prefill_hands_every_first_token_over(checkpoint_dir):
    worker = RecordingWorker()
    e = LLMEngine(engine(checkpoint_dir("qwen3"), False).config, producer(worker))
    prompt = tokens(30, 4)
    e.add_request("r", prompt, replace(SEEDED, n=3, max_tokens=1, logprobs=1),
                  {"decode_addr": "127.0.0.1:1"})
    outs = e.step()
    (handover,) = [h for m in worker.metas for h in m.handovers]
    firsts = {o.index: o.new_token_ids[0] for o in outs}
    assert handover.first_token == firsts[0]
    assert [t for t, _ in handover.choices] == [firsts[1], firsts[2]]
    assert all(dict(lp)[t] <= 0 for t, lp in handover.choices)
    worker.ack("r")
    e.step()
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def test_decode_forks_from_the_landed_blocks(checkpoint_dir):
    """The decode side loads the prompt once and forks the choices from the landed blocks with
    the prefill node's first tokens: full blocks shared, the tail block's landed KV copied."""
    worker = RecordingWorker()
    e = LLMEngine(engine(checkpoint_dir("qwen3"), True, num_kv_blocks=40).config, consumer(worker))
    start = e.block_manager.num_free_blocks
    e.add_request("r", tokens(70, 6), replace(SEEDED, n=4), {"prefill_addr": "127.0.0.1:1"})
    e.step()
    assert list(worker.loads) == ["r"]  # one load, whatever n is
    _, block_ids = worker.loads["r"]
    for cache in e.kv_caches:  # what the transfer would have written
        cache[:, block_ids] = torch.randn_like(cache[:, block_ids])
    worker.land("r", 11)
    worker.result.choice_firsts["r"] = [(12, None), (13, None), (14, None)]
    outs = e.step()
    firsts = {o.index: o.new_token_ids[0] for o in reversed(outs)}  # landed first, then a decode step
    assert firsts == {0: 11, 1: 12, 2: 13, 3: 14}
    seqs = [e._requests[choice_request_id("r", i)] for i in range(4)]
    assert all(e.block_manager._ref_counts[b] == 4 for b in block_ids[:4])
    tails = [s.block_table[4] for s in seqs]
    assert len(set(tails)) == 4
    for cache in e.kv_caches:  # the 6 prompt tokens of the tail block, in every copy
        assert all(torch.equal(cache[:, t, :6], cache[:, block_ids[4], :6]) for t in tails)
    got = run_all(e, outs)
    assert sorted(got) == [("r", i) for i in range(4)] and all(len(t) == 8 for t in got.values())
    assert e.block_manager.num_free_blocks == start


def test_decode_without_every_first_token_fails_the_request(checkpoint_dir):
    worker = RecordingWorker()
    e = LLMEngine(engine(checkpoint_dir("qwen3"), False, num_kv_blocks=40).config, consumer(worker))
    e.add_request("r", tokens(20, 6), replace(SEEDED, n=3), {"prefill_addr": "127.0.0.1:1"})
    e.step()
    worker.land("r", 11)  # a prefill node that sent choice 0's first token only
    (out,) = e.step()
    assert out.finish_reason == "error" and "n=3" in out.error
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks
