"""The scheduler driven by a fake runner whose 'model' output depends only on (request, position).

Whatever the batching, chunking or preemption, each request must then produce the same tokens.
"""

from __future__ import annotations

from common.engine.block_manager import BlockManager
from common.engine.kv_connector import KVConnectorScheduler
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.sequence import Sequence


def fake_token(seq: Sequence) -> int:
    return (hash(seq.request_id) + seq.num_tokens * 7) % 1000 + 10


def make_scheduler(num_blocks=64, block_size=4, budget=32, max_num_seqs=8, chunked=True):
    bm = BlockManager(num_blocks, block_size)
    return Scheduler(
        bm,
        KVConnectorScheduler(),
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=10_000,
        enable_chunked_prefill=chunked,
        eos_token_ids={0},
    )


def run(sched: Scheduler, seqs: list[Sequence], max_steps=10_000) -> list[int]:
    """Step until done; returns the per-step token counts."""
    for s in seqs:
        sched.add(s)
    per_step = []
    for _ in range(max_steps):
        if not sched.has_schedulable_work():
            break
        batch = sched.schedule()
        assert batch, "scheduler stalled with work left"
        assert batch.num_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        per_step.append(batch.num_tokens)
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            assert len(seq.block_table) * sched.block_manager.block_size >= seq.num_computed_tokens + n
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                sched.append_token(seq, fake_token(seq))
    return per_step


def make_seqs(lens, max_tokens=12):
    return [
        Sequence(f"r{i}", list(range(1, n + 1)), SamplingParams(temperature=0, max_tokens=max_tokens))
        for i, n in enumerate(lens)
    ]


def outputs(seqs):
    return {s.request_id: s.output_token_ids for s in seqs}


def test_batching_chunking_and_preemption_do_not_change_tokens():
    lens = [5, 41, 9, 23, 2, 17]
    reference = make_seqs(lens)
    sched = make_scheduler(num_blocks=1000, budget=1000)
    run(sched, reference[:1])
    for s in reference[1:]:
        run(sched, [s])
    expected = outputs(reference)

    chunked = make_seqs(lens)
    sched = make_scheduler(budget=8)
    steps = run(sched, chunked)
    assert outputs(chunked) == expected and max(steps) <= 8

    tight = make_seqs(lens)
    sched = make_scheduler(num_blocks=16, budget=16)  # 64 slots for 6 requests: forces preemption
    run(sched, tight)
    assert outputs(tight) == expected
    assert sum(s.num_preemptions for s in tight) > 0
    assert sched.block_manager.num_free_blocks == 16
    assert all(s.finish_reason == "length" for s in tight)


def test_decodes_run_alongside_a_chunked_prefill():
    sched = make_scheduler(budget=8)
    short, long = make_seqs([3, 60], max_tokens=30)
    run(sched, [short], max_steps=2)  # short is decoding
    sched.add(long)
    for _ in range(5):
        batch = sched.schedule()
        assert short in batch.seqs and long in batch.seqs  # the prefill never stalls the decode
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:
                sched.append_token(seq, fake_token(seq))


def test_max_num_seqs_and_no_chunking():
    seqs = make_seqs([10] * 5, max_tokens=3)
    sched = make_scheduler(max_num_seqs=2, budget=15, chunked=False)
    run(sched, seqs)
    assert all(len(s.output_token_ids) == 3 for s in seqs)
    assert sched.block_manager.num_free_blocks == 64


def test_stop_conditions():
    sched = make_scheduler()
    seq = Sequence("a", [1, 2], SamplingParams(max_tokens=10, stop_token_ids=[99]))
    sched.add(seq)
    sched.schedule()
    seq.num_computed_tokens = 2
    sched.append_token(seq, 99)
    assert seq.finish_reason == "stop" and sched.block_manager.num_free_blocks == 64
    eos = Sequence("b", [1], SamplingParams(max_tokens=10, ignore_eos=True))
    sched.add(eos)
    sched.schedule()
    sched.append_token(eos, 0)
    assert not eos.is_finished  # ignore_eos
    sched.finish(eos, "abort")
    assert sched.block_manager.num_free_blocks == 64 and not sched.has_schedulable_work()
