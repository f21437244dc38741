"""Fair share between clients (common/engine/fairness.py): the counters and the scheduler's
admission order, driven as tests/common/engine/test_engine_scheduler.py drives the scheduler."""

from __future__ import annotations

from common.engine.block_manager import BlockManager
from common.engine.fairness import PROMPT_WEIGHT, FairShare
from common.engine.kv_connector import KVConnectorScheduler
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import Scheduler
from common.engine.sequence import Sequence


def seq(rid: str, client: str, prompt: int = 8, max_tokens: int = 4, n: int = 1) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, client=client, n=n)
    return Sequence(rid, list(range(1, prompt + 1)), params)


def scheduler(max_num_seqs=8, cap=4096, fair_share=True, num_blocks=256) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 4), KVConnectorScheduler(), max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=64, max_model_len=10_000, enable_chunked_prefill=True,
                     eos_token_ids={0}, fair_share=fair_share, max_tokens_in_flight_per_client=cap)


def step(sched: Scheduler) -> list[str]:
    """One step with a fake model; the ids of the sequences it scheduled."""
    batch = sched.schedule()
    for s, n in zip(batch.seqs, batch.num_new_tokens):
        s.num_computed_tokens += n
        if s.num_computed_tokens == s.num_tokens:
            sched.append_token(s, 5)
    return [s.request_id for s in batch.seqs]


# ---- the counter ------------------------------------------------------------------------------
def test_counter_counts_weighted_prompt_and_output_tokens():
    fs = FairShare()
    a = seq("a", "A", prompt=10)
    fs.arrived(a)
    fs.admitted(a)
    fs.admitted(a)  # a preempted sequence re-admitted: its prompt is counted once
    fs.served("A", output_tokens=3)
    assert fs.counters["A"] == PROMPT_WEIGHT * 10 + 3


def test_a_client_active_again_is_lifted_to_the_smallest_active_counter():
    fs = FairShare()
    for rid, client in (("a", "A"), ("b", "B")):
        fs.arrived(seq(rid, client))
    fs.served("A", output_tokens=100)
    fs.served("B", output_tokens=40)
    fs.arrived(seq("c", "C"))  # new: it starts where the least-served active client is
    assert fs.counters["C"] == 40
    b = seq("b2", "B")
    fs.left(seq("b", "B"))  # B idle: it banks no credit while A keeps being served
    fs.served("A", output_tokens=100)
    fs.served("C", output_tokens=80)
    fs.arrived(b)
    assert fs.counters["B"] == 120  # min(A 200, C 120), not its old 40


def test_a_client_never_lifted_down():
    fs = FairShare()
    fs.arrived(seq("a", "A"))
    fs.served("A", output_tokens=10)
    fs.left(seq("a", "A"))
    fs.arrived(seq("b", "B"))
    fs.arrived(seq("a2", "A"))
    assert fs.counters["A"] == 10 and fs.counters["B"] == 0


# ---- admission --------------------------------------------------------------------------------
def test_the_flooded_client_waits_and_the_other_is_admitted_next():
    sched = scheduler(max_num_seqs=2)
    for i in range(6):
        sched.add(seq(f"a{i}", "A", max_tokens=50))
    step(sched)
    assert [s.request_id for s in sched.running] == ["a0", "a1"]
    sched.add(seq("b0", "B", max_tokens=2))
    for _ in range(200):
        if "b0" in step(sched):
            break
    # under its cap A keeps its slots; of the two it frees together one goes to B, not both to A's queue
    assert all(sched.find(f"a{i}").num_computed_tokens == 0 for i in range(3, 6))


def test_the_least_served_client_goes_first_fifo_within_a_client():
    sched = scheduler(max_num_seqs=1)
    order = []
    for rid, client in (("a0", "A"), ("a1", "A"), ("a2", "A"), ("b0", "B"), ("b1", "B")):
        sched.add(seq(rid, client, max_tokens=2))
    for _ in range(100):
        if not sched.has_schedulable_work():
            break
        for rid in step(sched):
            if rid not in order:
                order.append(rid)
    assert order.index("a0") < order.index("a1") < order.index("a2")
    assert order.index("b0") < order.index("b1")
    assert order.index("b0") < order.index("a1"), order  # A was served a0 first: B's turn


def test_a_client_over_its_cap_yields_a_slot_to_one_under_it():
    sched = scheduler(max_num_seqs=2, cap=60)
    sched.add(seq("a0", "A", max_tokens=50))
    sched.add(seq("a1", "A", max_tokens=50))
    step(sched)
    assert len(sched.running) == 2  # alone, A may go past its cap (work-conserving)
    sched.add(seq("b0", "B", max_tokens=2))
    assert "b0" in step(sched)  # A's newest sequence preempted for it
    assert sched.find("a1").num_preemptions == 1 and sched.find("a0").num_preemptions == 0


def test_preemptions_for_other_clients_go_round_a_clients_sequences():
    """Each preemption takes the newest of the sequences preempted least so far: one sequence taking
    every delay would finish last by all of them (9.5 % more steps in bench/fairness.py's flood)."""
    fair = FairShare(100)
    running = [seq(f"a{i}", "A", max_tokens=50) for i in range(3)]
    newcomer = seq("b0", "B", max_tokens=2)
    picked = []
    for _ in range(4):
        victim = fair.victim(running, newcomer)
        victim.num_preemptions += 1
        picked.append(victim.request_id)
    assert picked == ["a2", "a1", "a0", "a2"]
    assert fair.victim([seq("b1", "B", max_tokens=50)] * 3, newcomer) is None  # its own client's: never


def test_a_client_under_its_cap_keeps_its_sequences():
    sched = scheduler(max_num_seqs=2, cap=100)
    sched.add(seq("a0", "A", max_tokens=50))
    sched.add(seq("a1", "A", max_tokens=50))
    step(sched)
    sched.add(seq("b0", "B", max_tokens=2))
    assert "b0" not in step(sched)
    assert all(s.num_preemptions == 0 for s in sched.running)


def test_n_times_max_tokens_is_what_a_request_holds():
    sched = scheduler(max_num_seqs=4, cap=100)
    sched.add(seq("a0", "A", max_tokens=30, n=4))  # holds 120 > 100 once admitted
    sched.add(seq("a1", "A", max_tokens=2))
    sched.add(seq("b0", "B", max_tokens=2))
    first = step(sched)
    assert first[0] == "a0"
    assert sched.fairness.over_cap("A", sched.fairness.held(sched.running))


def test_one_client_is_plain_fifo():
    def admitted(fair: bool) -> list[str]:
        sched = scheduler(max_num_seqs=2, cap=1, fair_share=fair)
        order: list[str] = []
        for i in range(5):
            sched.add(seq(f"a{i}", "A", max_tokens=3 + i))
        while sched.has_schedulable_work():
            order += [r for r in step(sched) if r not in order]
        return order

    assert admitted(True) == admitted(False) == [f"a{i}" for i in range(5)]


def test_a_newcomer_beside_a_client_holding_the_slots_gets_a_step_of_its_own():
    sched = scheduler(max_num_seqs=4, cap=60)
    for i in range(4):
        sched.add(seq(f"a{i}", "A", max_tokens=50))
    step(sched)
    assert len(sched.running) == 4  # A alone holds every slot
    sched.add(seq("b0", "B", max_tokens=20))
    assert step(sched) == ["b0"]  # its prompt alone, not in a step beside A's four decodes
    assert sched.find("a3").num_preemptions == 1  # its slot came from A, over its cap
    assert "b0" in (after := step(sched)) and {"a0", "a1", "a2"} <= set(after)  # then everyone decodes
    sched.add(seq("b1", "B", max_tokens=2))  # B runs something already: no step of its own
    assert step(sched) != ["b1"]


def test_no_two_newcomer_steps_in_a_row():
    sched = scheduler(max_num_seqs=8, cap=4096)
    for i in range(6):
        sched.add(seq(f"a{i}", "A", max_tokens=50))
    step(sched)
    sched.add(seq("b0", "B", max_tokens=2))
    assert step(sched) == ["b0"]
    sched.add(seq("c0", "C", max_tokens=2))
    mixed = step(sched)  # not a second one: C joins A's and B's decodes in one step
    assert {f"a{i}" for i in range(6)} | {"b0", "c0"} == set(mixed)


def test_no_newcomer_step_when_no_client_holds_half_the_slots():
    sched = scheduler(max_num_seqs=8)
    for rid, client in (("a0", "A"), ("b0", "B"), ("c0", "C")):
        sched.add(seq(rid, client, max_tokens=50))
    step(sched)
    sched.add(seq("d0", "D", max_tokens=2))
    assert {"a0", "b0", "c0", "d0"} <= set(step(sched))  # one mixed step, as without fair share


def test_a_newcomer_beside_a_client_with_a_step_of_prompts_gets_a_step_of_its_own():
    """A's burst of prompts (half the token budget or more) would fill the next step: B's first
    request, arriving while A runs one, is not computed inside it (bench/fairness.py's first B)."""
    sched = scheduler(max_num_seqs=8)  # 64 tokens a step
    sched.add(seq("a0", "A", max_tokens=50))
    step(sched)  # A runs one request
    for i in range(1, 5):
        sched.add(seq(f"a{i}", "A", prompt=16, max_tokens=50))  # 64 prompt tokens waiting
    sched.add(seq("b0", "B", max_tokens=2))
    assert step(sched) == ["b0"]
    assert {"a0", "a1", "a2", "a3"} <= set(step(sched))  # then A's decode and prompts


def test_no_newcomer_step_beside_a_few_prompt_tokens():
    sched = scheduler(max_num_seqs=8)
    sched.add(seq("a0", "A", max_tokens=50))
    step(sched)
    sched.add(seq("a1", "A", prompt=16, max_tokens=50))  # 16 < half of 64
    sched.add(seq("b0", "B", max_tokens=2))
    assert {"a0", "a1", "b0"} <= set(step(sched))  # one mixed step, as without fair share


def test_a_burst_arriving_at_once_gives_each_client_first_request_a_step_of_their_own():
    sched = scheduler(max_num_seqs=8)
    for i in range(4):
        sched.add(seq(f"a{i}", "A", prompt=16, max_tokens=50))  # 48 prompt tokens past A's first
    sched.add(seq("b0", "B", max_tokens=2))
    assert step(sched) == ["a0", "b0"]  # not B's prompt inside a step full of A's
    assert {"a1", "a2", "a3"} <= set(step(sched))
