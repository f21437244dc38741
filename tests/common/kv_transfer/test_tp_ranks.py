"""tp_ranks: rank 0 broadcasts connector metadata to the worker ranks and turns every rank's
FinishedTransfers into one outcome per request (RankOutcomes, LeaderKVWorker)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import msgpack
import pytest

from common.engine.kv_connector import (DiscardSpec, FinishedTransfers, HandoverSpec, KVConnectorMetadata,
                                        LoadSpec, SaveSpec)
from common.kv_transfer.consumer_table import ConsumerTable
from common.kv_transfer.workers import ConsumerWorker
from common.kv_transfer.tp_ranks import (KV_ISSUE, KV_POLL, LeaderKVWorker, RankOutcomes, decode_meta, decode_report,
                                         encode_meta, encode_report, for_rank, rank_address)


def _tuples(x):
    """msgpack gives lists where the original had tuples: compare both as nested tuples."""
    return tuple(_tuples(v) for v in x) if isinstance(x, (list, tuple)) else x


def _norm(meta: KVConnectorMetadata) -> tuple:
    return tuple(_tuples([dataclasses.astuple(s) for s in getattr(meta, name)])
                 for name in ("loads", "saves", "handovers", "discards")) + (_tuples(meta.aborts),
                                                                               _tuples(meta.releases))


def full_meta() -> KVConnectorMetadata:
    return KVConnectorMetadata(
        loads=(LoadSpec("L1", "10.0.0.1:5000", (3, 4, 5), 1, 40), LoadSpec("L2", "[::1]:6000", (9,), 0, 7)),
        saves=(SaveSpec("S1", 2, "10.0.0.2:7000", (1, 2), 20),),
        handovers=(HandoverSpec("H1", "10.0.0.2:7000", 42, ((42, -0.5), (7, -1.25)), (1, 2, 3), 33,
                                choices=((8, ((8, -0.1),)), (9, ())), num_cached_tokens=16),
                   HandoverSpec("H2", "10.0.0.3:7001", 5, None, (6,), 4)),
        discards=(DiscardSpec("D1", "client went away"),),
        aborts=("A1", "A2"),
        releases=(("R1", "10.0.0.1:5000"), ("R2", "10.0.0.4:5100")))


# ---- wire formats ---------------------------------------------------------------------------
def test_meta_round_trip_every_field():
    """encode_meta/decode_meta keep every spec, abort and release, field by field."""
    meta = full_meta()
    back = decode_meta(encode_meta(meta))
    assert _norm(back) == _norm(meta)
    assert [type(s) for s in back.loads + back.saves + back.handovers + back.discards] == \
        [LoadSpec, LoadSpec, SaveSpec, HandoverSpec, HandoverSpec, DiscardSpec]
    assert back.handovers[1].first_logprobs is None and back.handovers[0].num_cached_tokens == 16
    assert decode_meta(encode_meta(KVConnectorMetadata())) == KVConnectorMetadata()


def test_report_round_trip():
    """encode_report/decode_report keep freeable, stopped, the done ids and the failure messages."""
    f = FinishedTransfers(freeable={"p1", "p2"}, stopped={"s1"}, done_recving={"d1": 17, "d2": 3},
                          failed_recving={"f1": "peer gone", "f2": "timeout"})
    back = decode_report(encode_report(f))
    assert back.freeable == {"p1", "p2"} and back.stopped == {"s1"}
    assert set(back.done_recving) == {"d1", "d2"}
    assert back.failed_recving == {"f1": "peer gone", "f2": "timeout"}
    assert decode_report(encode_report(FinishedTransfers())) == FinishedTransfers()


# ---- addresses per rank --------------------------------------------------------------------
def test_rank_address():
    """Rank r of a peer listens at port + r on the same host (an IPv6 host keeps its brackets)."""
    assert rank_address("10.0.0.1:5000", 2) == "10.0.0.1:5002"
    assert rank_address("10.0.0.1:5000", 0) == "10.0.0.1:5000"
    assert rank_address("[::1]:5000", 3) == "[::1]:5003"


def test_for_rank_moves_only_peer_addresses():
    """for_rank(meta, 0) is meta itself; rank 1 gets every peer address +1 and nothing else changed."""
    meta = full_meta()
    assert for_rank(meta, 0) is meta
    r1 = for_rank(meta, 1)
    assert [s.prefill_addr for s in r1.loads] == ["10.0.0.1:5001", "[::1]:6001"]
    assert [s.decode_addr for s in r1.saves] == ["10.0.0.2:7001"]
    assert [s.decode_addr for s in r1.handovers] == ["10.0.0.2:7001", "10.0.0.3:7002"]
    assert r1.releases == (("R1", "10.0.0.1:5001"), ("R2", "10.0.0.4:5101"))
    for moved, orig, addr in ((r1.loads, meta.loads, "prefill_addr"), (r1.saves, meta.saves, "decode_addr"),
                              (r1.handovers, meta.handovers, "decode_addr")):
        assert [dataclasses.replace(s, **{addr: "x"}) for s in moved] == \
            [dataclasses.replace(s, **{addr: "x"}) for s in orig]  # ids, blocks, tokens unchanged
    assert r1.discards == meta.discards and r1.aborts == meta.aborts


# ---- RankOutcomes: decode side --------------------------------------------------------------
def landed(rid: str, token: int, **extras) -> FinishedTransfers:
    return FinishedTransfers(done_recving={rid: token}, **{k: {rid: v} for k, v in extras.items()})


def empty(n: int) -> list[FinishedTransfers]:
    return [FinishedTransfers() for _ in range(n)]


@pytest.mark.parametrize("size", [2, 4])
def test_load_done_only_when_every_rank_landed_with_rank0_extras(size):
    """Rank 0 lands first; the outcome (rank 0's token and extras) waits for the last rank."""
    o = RankOutcomes(size)
    o.expect_load("r")
    assert o.landing("r")
    first = landed("r", 42, first_logprobs={42: -0.5}, choice_firsts=[(7, None)], cached_tokens=16)
    out, stop = o.combine([first] + empty(size - 1))
    assert out == FinishedTransfers() and stop == [] and o.landing("r")
    for rank in range(1, size):
        reps = empty(size)
        reps[rank] = landed("r", 999, first_logprobs={999: -9.0}, cached_tokens=1)  # worker's own: ignored
        out, stop = o.combine(reps)
        if rank < size - 1:
            assert out == FinishedTransfers() and o.landing("r")
    assert stop == []
    assert out == FinishedTransfers(done_recving={"r": 42}, first_logprobs={"r": {42: -0.5}},
                                    choice_firsts={"r": [(7, None)]}, cached_tokens={"r": 16})
    assert not o.landing("r")
    assert o.combine(empty(size)) == (FinishedTransfers(), [])


@pytest.mark.parametrize("size", [2, 4])
def test_one_rank_fails_others_stopped_then_failed_once(size):
    """A worker rank fails: the others are told to stop once; the failure, naming that rank, is
    reported only when every rank has ended (stopped, or landed before the stop), never as done."""
    o = RankOutcomes(size)
    o.expect_load("r")
    reps = empty(size)
    reps[1] = FinishedTransfers(failed_recving={"r": "peer gone"})
    out, stop = o.combine(reps)
    assert out == FinishedTransfers() and stop == ["r"] and o.landing("r")
    for rank in range(2, size):
        reps = empty(size)
        reps[rank] = FinishedTransfers(stopped={"r"})
        out, stop = o.combine(reps)
        assert (out, stop) == (FinishedTransfers(), []) and o.landing("r")
    out, stop = o.combine([landed("r", 5)] + empty(size - 1))  # rank 0 landed before the stop reached it
    assert (out, stop) == (FinishedTransfers(failed_recving={"r": "tensor-parallel rank 1: peer gone"}), [])
    assert not o.landing("r")
    assert o.combine(empty(size)) == (FinishedTransfers(), [])


def test_first_failure_wins_and_stop_is_asked_once():
    """Two ranks fail in turn: one stop request, and the message is the first rank's."""
    o = RankOutcomes(4)
    o.expect_load("r")
    out, stop = o.combine([FinishedTransfers(), FinishedTransfers(),
                           FinishedTransfers(failed_recving={"r": "b"}), FinishedTransfers()])
    assert stop == ["r"]
    out, stop = o.combine([FinishedTransfers(), FinishedTransfers(failed_recving={"r": "a"}),
                           FinishedTransfers(), FinishedTransfers(stopped={"r"})])
    assert (out, stop) == (FinishedTransfers(), [])
    out, stop = o.combine([FinishedTransfers(stopped={"r"})] + empty(3))
    assert (out, stop) == (FinishedTransfers(failed_recving={"r": "tensor-parallel rank 2: b"}), [])


@pytest.mark.parametrize("size", [2, 4])
def test_scheduler_abort_reported_as_stopped_only(size):
    """After aborted(rid), the ranks' stops, landings or failures add up to one 'stopped'."""
    o = RankOutcomes(size)
    o.expect_load("r")
    o.aborted("r")
    out, stop = o.combine([FinishedTransfers(stopped={"r"})] + empty(size - 1))
    assert (out, stop) == (FinishedTransfers(), []) and o.landing("r")
    reps = [FinishedTransfers()] + [landed("r", 1) if rank % 2 else FinishedTransfers(stopped={"r"})
                                    for rank in range(1, size)]
    reps[-1] = FinishedTransfers(failed_recving={"r": "cut off"})
    out, stop = o.combine(reps)
    assert (out, stop) == (FinishedTransfers(stopped={"r"}), [])
    assert not o.landing("r")


def test_aborted_unknown_request_is_a_no_op():
    """aborted() of a request with no load expected changes nothing."""
    o = RankOutcomes(2)
    o.aborted("x")
    assert not o.landing("x") and o.loads == {}


def test_load_expected_on_rank0_only():
    """A load only rank 0 took (refused there at once) ends from rank 0's report alone."""
    o = RankOutcomes(4)
    o.expect_load("r", frozenset({0}))
    out, _ = o.combine([FinishedTransfers(failed_recving={"r": "unknown peer"})] +
                       [FinishedTransfers(stopped={"r"}), landed("r", 3), FinishedTransfers()])
    assert out == FinishedTransfers(failed_recving={"r": "tensor-parallel rank 0: unknown peer"})
    assert not o.landing("r")
    o.expect_load("s", frozenset({0}))
    out, stop = o.combine([landed("s", 8, cached_tokens=2)] + empty(3))
    assert (out, stop) == (FinishedTransfers(done_recving={"s": 8}, cached_tokens={"s": 2}), [])


def test_unknown_ids_workers_ignored_rank0_passed_through():
    """Worker reports for requests never expected are dropped; rank 0's pass through unchanged."""
    o = RankOutcomes(2)
    worker = FinishedTransfers(freeable={"w"}, stopped={"w1"}, done_recving={"w2": 1},
                               failed_recving={"w3": "x"})
    rank0 = FinishedTransfers(done_recving={"d": 11}, first_logprobs={"d": {11: -0.2}},
                              choice_firsts={"d": [(4, {4: -1.0})]}, cached_tokens={"d": 32},
                              failed_recving={"f": "boom"}, stopped={"s"}, freeable={"p"})
    out, stop = o.combine([rank0, worker])
    assert stop == []
    assert out == FinishedTransfers(done_recving={"d": 11}, first_logprobs={"d": {11: -0.2}},
                                    choice_firsts={"d": [(4, {4: -1.0})]}, cached_tokens={"d": 32},
                                    failed_recving={"f": "boom"}, stopped={"s"}, freeable={"p"})


# ---- RankOutcomes: prefill side -------------------------------------------------------------
@pytest.mark.parametrize("size", [2, 4])
def test_freeable_once_every_rank_released(size):
    """A held hand-over is freeable once every rank released it, reported exactly once."""
    o = RankOutcomes(size)
    o.expect_release("h")
    for rank in reversed(range(size)):  # rank 0 last
        reps = empty(size)
        reps[rank] = FinishedTransfers(freeable={"h"})
        out, _ = o.combine(reps)
        if rank:
            assert out.freeable == set()
    assert out == FinishedTransfers(freeable={"h"})
    assert o.combine([FinishedTransfers(freeable={"h"})] * size)[0] == FinishedTransfers(freeable={"h"})  # now unknown


def test_freeable_all_ranks_in_one_report_and_unexpected_rank0():
    """All ranks at once free it; rank 0's freeable for an id never held passes straight through."""
    o = RankOutcomes(2)
    o.expect_release("h")
    out, _ = o.combine([FinishedTransfers(freeable={"h", "other"}), FinishedTransfers(freeable={"h", "w"})])
    assert out == FinishedTransfers(freeable={"h", "other"})


# ---- LeaderKVWorker ---------------------------------------------------------------------------
class FakeLeader:
    def __init__(self, size: int) -> None:
        self.size = size
        self.sent: list[tuple] = []
        self.sent_bytes: list[tuple[int, bytes]] = []
        self.replies: list[list[bytes]] = []  # each gather's worker replies (ranks 1..)

    def send(self, op, values=(), payload=None):
        self.sent.append((op, values, payload))

    def send_bytes(self, op, data):
        self.sent_bytes.append((op, data))

    def gather_bytes(self, data):
        return [data] + self.replies.pop(0)


class FakeInner(ConsumerWorker):
    def __init__(self) -> None:
        super().__init__()
        self.issued: list[KVConnectorMetadata] = []
        self.refused: set[str] = set()
        self.reports: list[FinishedTransfers] = []
        self.transfer = SimpleNamespace(consumer=SimpleNamespace(table=ConsumerTable(), known_peer=self.known))
        self.unknown: set[str] = set()  # prefill addresses rank 0 would not pull from

    def known(self, addr: str) -> bool:
        return addr not in self.unknown

    def issue(self, meta):
        self.issued.append(meta)
        for load in meta.loads:  # as the real worker does with a load its consumer refused: FAILED in the table
            if load.request_id in self.refused:
                self.transfer.consumer.table.start(load.request_id, [], 0, [], 0, None, error="bad request")

    def get_finished(self):
        return self.reports.pop(0) if self.reports else FinishedTransfers()


def reply(stats: dict, f: FinishedTransfers) -> bytes:
    return msgpack.packb([stats, encode_report(f)])


def test_leader_issue_forwards_and_keeps_refused_loads_local():
    """issue() hands rank 0 the whole metadata and the workers all but the loads rank 0 refused;
    a refused load then fails from rank 0's report alone."""
    leader, inner = FakeLeader(2), FakeInner()
    w = LeaderKVWorker(inner, leader, "decode")
    meta = full_meta()
    inner.refused = {"L2"}
    w.issue(meta)
    assert inner.issued == [meta]
    [(op, data)] = leader.sent_bytes
    assert op == KV_ISSUE
    # the workers' releases carry the prefill node's TP size (0: unknown), for their routes
    releases = tuple((rid, addr, 0) for rid, addr in meta.releases)
    assert _norm(decode_meta(data)) == _norm(dataclasses.replace(meta, loads=meta.loads[:1], releases=releases))
    assert w.outcomes.landing("L1") and w.outcomes.landing("L2")

    inner.reports = [FinishedTransfers(failed_recving={"L2": "bad request"})]
    leader.replies = [[reply({"pulls": 1}, FinishedTransfers())]]
    assert w.get_finished() == FinishedTransfers(failed_recving={"L2": "tensor-parallel rank 0: bad request"})
    assert w.outcomes.landing("L1") and not w.outcomes.landing("L2")


def test_leader_issue_with_only_refused_loads_sends_nothing():
    """A metadata left empty once rank 0's refused loads are taken out is not broadcast."""
    leader, inner = FakeLeader(2), FakeInner()
    inner.refused = {"L1"}
    w = LeaderKVWorker(inner, leader, "decode")
    w.issue(KVConnectorMetadata(loads=(LoadSpec("L1", "h:1", (1,), 0, 4),)))
    assert leader.sent_bytes == [] and len(inner.issued) == 1


def test_leader_handover_freed_when_every_rank_released():
    """issue() of a hand-over expects its release on every rank; get_finished frees it once all did."""
    leader, inner = FakeLeader(3), FakeInner()
    w = LeaderKVWorker(inner, leader, "prefill")
    w.issue(KVConnectorMetadata(handovers=(HandoverSpec("h", "d:1", 1, None, (1,), 4),)))
    inner.reports = [FinishedTransfers(freeable={"h"})]
    leader.replies = [[reply({}, FinishedTransfers(freeable={"h"})), reply({}, FinishedTransfers())],
                      [reply({}, FinishedTransfers()), reply({}, FinishedTransfers(freeable={"h"}))]]
    assert w.get_finished() == FinishedTransfers()
    assert w.get_finished() == FinishedTransfers(freeable={"h"})


def test_leader_get_finished_combines_and_keeps_stats():
    """get_finished polls the workers (KV_POLL), stores each one's stats and returns one outcome."""
    leader, inner = FakeLeader(3), FakeInner()
    w = LeaderKVWorker(inner, leader, "decode")
    w.issue(KVConnectorMetadata(loads=(LoadSpec("r", "h:1", (1, 2), 0, 8),)))
    inner.reports = [landed("r", 77, first_logprobs={77: -0.3})]
    leader.replies = [[reply({"bytes": 10}, landed("r", 0)), reply({"bytes": 20}, FinishedTransfers())],
                      [reply({"bytes": 11}, FinishedTransfers()), reply({"bytes": 21}, landed("r", 0))]]
    assert w.get_finished() == FinishedTransfers()
    assert [op for op, _, _ in leader.sent] == [KV_POLL]
    assert w.rank_stats[1:] == [{"bytes": 10}, {"bytes": 20}]
    assert w.get_finished() == FinishedTransfers(done_recving={"r": 77}, first_logprobs={"r": {77: -0.3}})
    assert w.rank_stats[1:] == [{"bytes": 11}, {"bytes": 21}] and len(leader.sent) == 2


def test_leader_worker_failure_broadcasts_abort():
    """A worker's failure aborts the load on rank 0 (its table still receiving) and on every worker;
    the failure is reported once rank 0's part has stopped."""
    leader, inner = FakeLeader(2), FakeInner()
    w = LeaderKVWorker(inner, leader, "decode")
    table = inner.transfer.consumer.table
    table.load_pending("r")
    table.issue("r")  # LOADING on rank 0: may still receive
    w.issue(KVConnectorMetadata(loads=(LoadSpec("r", "h:1", (1,), 0, 4),)))
    leader.sent_bytes.clear()
    leader.replies = [[reply({}, FinishedTransfers(failed_recving={"r": "checksum"}))],
                      [reply({}, FinishedTransfers())]]
    assert w.get_finished() == FinishedTransfers()
    [(op, data)] = leader.sent_bytes
    assert op == KV_ISSUE and decode_meta(data) == KVConnectorMetadata(aborts=("r",))
    assert inner.issued[-1] == KVConnectorMetadata(aborts=("r",))
    assert table.state("r").value == "aborting"
    inner.reports = [FinishedTransfers(stopped={"r"})]
    assert w.get_finished() == FinishedTransfers(failed_recving={"r": "tensor-parallel rank 1: checksum"})
    assert len(leader.sent_bytes) == 1  # no second abort


def test_leader_abort_skips_rank0_when_nothing_lands_there():
    """Rank 0's own abort keeps only loads its table still receives; the workers get the abort anyway."""
    leader, inner = FakeLeader(2), FakeInner()
    w = LeaderKVWorker(inner, leader, "decode")
    w.issue(KVConnectorMetadata(loads=(LoadSpec("r", "h:1", (1,), 0, 4),)))
    leader.replies = [[reply({}, FinishedTransfers(failed_recving={"r": "x"}))]]
    assert w.get_finished() == FinishedTransfers()
    assert inner.issued[-1].aborts == ()
    assert decode_meta(leader.sent_bytes[-1][1]).aborts == ("r",)


def test_leader_forwards_no_release_naming_a_prefill_node_rank0_would_not_pull_from():
    """Keyless, a request's id may name any address: its release reaches the worker ranks (whose
    consumers know no peers of their own, and would open a connection to it) only when rank 0
    would pull from that address."""
    leader, inner = FakeLeader(2), FakeInner()
    w = LeaderKVWorker(inner, leader, "decode")
    inner.unknown = {"10.0.0.4:5100"}
    w.issue(full_meta())
    [(_, data)] = leader.sent_bytes
    assert [(rid, addr) for rid, addr, *_ in decode_meta(data).releases] == [("R1", "10.0.0.1:5000")]


def test_leader_polls_the_workers_only_while_a_transfer_is_pending():
    """The engine asks for finished transfers twice a loop iteration: with no multi-rank load or
    hand-over pending, rank 0's own report is the answer and the workers are not polled."""
    leader, inner = FakeLeader(2), FakeInner()
    w = LeaderKVWorker(inner, leader, "decode")
    inner.reports = [FinishedTransfers(failed_recving={"solo": "rank 0 only"})]
    assert w.get_finished() == FinishedTransfers(failed_recving={"solo": "rank 0 only"})
    assert w.get_finished() == FinishedTransfers() and leader.sent == []
    w.issue(KVConnectorMetadata(loads=(LoadSpec("r", "h:1", (1, 2), 0, 8),)))
    inner.reports = [landed("r", 5)]
    leader.replies = [[reply({}, landed("r", 0))]]
    assert w.get_finished() == FinishedTransfers(done_recving={"r": 5})
    assert [op for op, _, _ in leader.sent] == [KV_POLL]
    assert w.get_finished() == FinishedTransfers() and len(leader.sent) == 1  # settled: no poll again

