"""The connector split: the scheduler side decides and writes one metadata object per step;
the worker side is the only one that touches the KV endpoint.

The scheduler runs without a model (the test plays the runner: it marks the scheduled tokens
computed and samples a fixed token); the worker side runs against a recording KV endpoint.
"""

from __future__ import annotations

import dataclasses
import pickle
from types import SimpleNamespace

from common.engine.block_manager import BlockManager
from common.kv_transfer.consumer_table import ConsumerState
from common.kv_transfer.producer_table import ProducerState
from common.engine.kv_connector import (DiscardSpec, FinishedTransfers, HandoverSpec,
                                        KVConnectorMetadata, LoadSpec, SaveSpec)
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler import ScheduledBatch, Scheduler
from common.engine.sequence import Sequence
from common.kv_transfer.consumer_table import ConsumerTable
from common.kv_transfer.producer_table import ProducerTable
from decode_node.connector import ConsumerConnector, ConsumerScheduler
from prefill_node.connector import ProducerConnector, ProducerScheduler

BS = 4
TO_D = {"decode_addr": "10.0.0.2:14580"}
FROM_P = {"prefill_addr": "10.0.0.1:14579"}
FIRST = 1


def make(connector, budget=64, prefix_caching=False, num_blocks=32) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, BS, prefix_caching), connector, max_num_seqs=8,
                     max_num_batched_tokens=budget, max_model_len=1000, enable_chunked_prefill=True,
                     eos_token_ids={0})


def seq(rid, n, tags=None, max_tokens=1, start=100) -> Sequence:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Sequence(rid, list(range(start, start + n)), params, kv_transfer_params=dict(tags or {}))


def compute(s: Scheduler, batch: ScheduledBatch) -> None:
    """What the engine does after the forward: tokens computed, a token sampled where complete."""
    for q, n in zip(list(batch.seqs), batch.num_new_tokens):
        q.num_computed_tokens += n
        if q.num_computed_tokens == q.num_tokens:
            s.append_token(q, FIRST)


def leaves(value):
    if dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from leaves(getattr(value, f.name))
    elif isinstance(value, tuple):
        for v in value:
            yield from leaves(v)
    else:
        yield value


def test_metadata_is_frozen_plain_data():
    meta = KVConnectorMetadata(loads=(LoadSpec("a", "h:1", (3, 4), 1, 9),),
                               saves=(SaveSpec("b", 0, "h:2", (1, 2), 8),),
                               handovers=(HandoverSpec("c", "h:2", 7, ((7, -0.5),), (5,), 3),),
                               discards=(DiscardSpec("d", "why"),), aborts=("e",))
    assert all(isinstance(v, (str, int, float)) for v in leaves(meta))
    assert pickle.loads(pickle.dumps(meta)) == meta  # what N tensor-parallel workers would be sent
    assert not KVConnectorMetadata() and meta


def test_scheduler_side_holds_no_transfer_engine():
    transfer = SimpleNamespace(producer=SimpleNamespace(table=ProducerTable()), consumer=SimpleNamespace(table=ConsumerTable()))
    for connector in (ProducerConnector(), ConsumerConnector()):
        connector.bind(transfer, [])
        held = vars(connector.scheduler).values()
        assert not any(v is transfer or v is transfer.producer or v is transfer.consumer for v in held)
    # and it decides without one: a scheduler built on a bare scheduler side plans a load
    s = make(ConsumerScheduler())
    s.add(seq("x", 9, FROM_P))
    assert s.schedule().kv_connector_metadata.loads[0].request_id == "x"


def test_saves_only_for_the_pass_that_completes_the_prompt_then_hands_over():
    conn = ProducerScheduler()
    s = make(conn, budget=4)
    s.add(seq("local", 2))
    s.add(seq("x", 10, TO_D))
    metas = []
    while s.has_schedulable_work():
        batch = s.schedule()
        metas.append(batch.kv_connector_metadata)
        compute(s, batch)
        metas.append(s.take_kv_metadata())
    saves = [sv for m in metas for sv in m.saves]
    assert len(saves) == 1  # 10 tokens in passes of 4, 4, 2: the last one saves
    [save] = saves
    x = s.blocks_lent["x"]
    assert save == SaveSpec("x", 0, TO_D["decode_addr"], tuple(x.block_table), 10)
    [handover] = [h for m in metas for h in m.handovers]
    assert handover == HandoverSpec("x", TO_D["decode_addr"], FIRST, None, tuple(x.block_table), 10)
    assert conn.state("x") is ProducerState.HANDED_OVER and not any(m.discards for m in metas)
    # the hand-over is in the metadata right after the step that sampled (not one step later)
    first_with = [next(i for i, m in enumerate(metas) if getattr(m, kind)) for kind in ("saves", "handovers")]
    assert first_with[1] == first_with[0] + 1

    s.process_transfers(FinishedTransfers(freeable={"x", "unknown"}))
    assert s.block_manager.num_free_blocks == 32 and conn.state("x") is None and not s.blocks_lent


def test_abort_before_the_first_token_is_discarded_and_frees_at_once():
    conn = ProducerScheduler()
    s = make(conn, budget=4)
    x = seq("x", 10, TO_D)
    s.add(x)
    compute(s, s.schedule())
    s.finish(x, "abort")
    assert s.block_manager.num_free_blocks == 32 and not s.blocks_lent
    assert s.take_kv_metadata() == KVConnectorMetadata(discards=(DiscardSpec(
        "x", "prefill ended (abort) before the first token"),))
    assert conn.state("x") is None


def test_load_asks_only_for_blocks_after_the_cached_prefix():
    conn = ConsumerScheduler()
    s = make(conn, prefix_caching=True)
    local = seq("local", 9, max_tokens=2)  # 2 full blocks get cached
    s.add(local)
    while s.has_schedulable_work():
        compute(s, s.schedule())
    s.add(seq("x", 14, FROM_P))  # shares the 8 cached tokens
    batch = s.schedule()
    x = s.parked["x"]
    assert not batch and batch.kv_connector_metadata == KVConnectorMetadata(loads=(
        LoadSpec("x", FROM_P["prefill_addr"], tuple(x.block_table[2:]), 2, 14),))
    assert len(x.block_table) == 4 and conn.state("x") is ConsumerState.LOADING

    s.process_transfers(FinishedTransfers(done_recving={"x": 42}, first_logprobs={"x": {42: -0.1}}))
    assert conn.state("x") is None and x.output_token_ids == [42] and x.num_computed_tokens == 14


def test_abort_before_hand_off_drops_the_load_and_frees_blocks():
    conn = ConsumerScheduler()
    s = make(conn)
    x = seq("x", 9, FROM_P)
    x.block_table = s.block_manager.allocate(3)
    conn.on_blocks_allocated(x, 0)
    assert conn.state("x") is ConsumerState.LOAD_PENDING and conn.has_pending()
    assert conn.request_finished(x) is False  # nobody writes into the blocks: free them now
    assert conn.state("x") is None and not conn.has_pending() and not conn.build_meta()


def test_abort_after_hand_off_holds_blocks_until_the_receive_stops():
    conn = ConsumerScheduler()
    s = make(conn)
    x = seq("x", 9, FROM_P, max_tokens=4)
    s.add(x)
    assert s.schedule().kv_connector_metadata.loads
    s.finish(x, "abort")  # e.g. the client went away: AsyncLLMEngine's abort command, between steps
    assert conn.state("x") is ConsumerState.ABORTING and "x" in s.blocks_lent
    assert s.take_kv_metadata() == KVConnectorMetadata(aborts=("x",))
    assert s.process_transfers(FinishedTransfers(done_recving={"x": 42})) == []  # raced landing: dropped
    assert s.block_manager.num_free_blocks == 29
    s.process_transfers(FinishedTransfers(stopped={"x"}))
    assert s.block_manager.num_free_blocks == 32 and not s.blocks_lent and conn.state("x") is None


def test_failed_load_finishes_with_error():
    conn = ConsumerScheduler()
    s = make(conn)
    x = seq("x", 9, FROM_P, max_tokens=4)
    s.add(x)
    s.schedule()
    [touched] = s.process_transfers(FinishedTransfers(failed_recving={"x": "peer gone", "y": "not ours"}))
    assert touched is x and x.error == "peer gone" and s.block_manager.num_free_blocks == 32
    assert not s.take_kv_metadata()  # a failed load needs no abort


class RecordingTransfer:
    """The KV endpoint's producer and consumer halves, recording every call."""

    def __init__(self, refuse: str | None = None):
        self.calls: list[tuple] = []
        rec = self.calls
        failed: dict[str, str] = {}  # what ``refuse`` recorded, as the real table would: the next poll's

        class Half:
            def __getattr__(self, name):
                def call(*args, **kw):
                    if name == "request" and refuse:
                        raise ValueError(refuse)
                    if name == "refuse":
                        failed[args[0]] = args[1]
                        return None
                    rec.append((name, *args, *kw.values()))
                    if name == "poll_finished":
                        out = ({}, dict(failed))
                        failed.clear()
                        return out
                    return set() if name in ("poll_freeable", "poll_aborted") else None
                return call

        self.producer = self.consumer = Half()


def test_producer_worker_issues_the_metadata():
    transfer, caches = RecordingTransfer(), ["layer0", "layer1"]
    conn = ProducerConnector()
    conn.bind(transfer, caches)
    meta = KVConnectorMetadata(saves=(SaveSpec("x", 1, "h:2", (4, 5), 6),),
                               handovers=(HandoverSpec("y", "h:2", 9, ((9, -0.25),), (1, 2), 5, num_cached_tokens=3),),
                               discards=(DiscardSpec("z", "gone"),))
    conn.worker.issue(meta)
    conn.worker.save_kv_layer(0, "kv0", meta)
    assert transfer.calls == [("discard", "z", "gone"), ("finish", "y", 9, caches, [1, 2], 5, {9: -0.25}, [], 3),
                              ("save_layer", "x", 0, "kv0", [4, 5])]


def test_consumer_worker_issues_the_metadata_and_reports_refused_loads():
    transfer, caches = RecordingTransfer(), ["layer0"]
    conn = ConsumerConnector()
    conn.bind(transfer, caches)
    conn.worker.issue(KVConnectorMetadata(loads=(LoadSpec("x", "h:1", (7, 8), 2, 15),), aborts=("w",)))
    assert transfer.calls == [("abort", "w"), ("request", "x", "h:1", [7, 8], 15, caches, 2)]

    refusing = ConsumerConnector()
    refusing.bind(RecordingTransfer(refuse="first block 9 is outside"), caches)
    refusing.worker.issue(KVConnectorMetadata(loads=(LoadSpec("x", "h:1", (7,), 9, 15),)))
    assert refusing.worker.get_finished().failed_recving == {"x": "first block 9 is outside"}


def test_received_blocks_join_the_prefix_cache_only_when_their_request_finishes_normally():
    """KV a peer sent is named in the prefix cache (and so served to other requests) only once
    its request ended with stop or length: a request that failed or was aborted names nothing."""
    s = make(ConsumerScheduler(), prefix_caching=True)
    for rid, start, reason in (("x", 100, "error"), ("y", 200, "abort"), ("z", 300, "length")):
        q = seq(rid, 9, FROM_P, max_tokens=4, start=start)  # 2 full blocks of 4 tokens
        s.add(q)
        s.schedule()
        s.process_transfers(FinishedTransfers(done_recving={rid: 42}))
        assert q.num_computed_tokens == 9 and q.output_token_ids == [42]
        s.finish(q, reason)
        assert s.block_manager.num_cached_blocks == (2 if reason == "length" else 0), reason
