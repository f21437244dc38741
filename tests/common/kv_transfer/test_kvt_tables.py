"""The two tables that own a transfer's one record (producer_table.py, consumer_table.py):
the moves their docstrings list, and the races they settle, without threads or sockets."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from common.kv_transfer import consumer_table, producer_table
from common.kv_transfer.consumer_table import ConsumerState as C
from common.kv_transfer.consumer_table import ConsumerTable, IllegalMove
from common.kv_transfer.producer_table import ProducerState as S
from common.kv_transfer.producer_table import ProducerTable

LINK = object()  # stands in for the link thread a record is handed to


def pull(t: ProducerTable, rid: str, deadline: float, link=None):
    return t.pulled(rid, deadline, link, [], 0, 0, 0)


def finish(t: ProducerTable, rid: str, deadline: float):
    return t.finish(rid, deadline, first_token=0, first_logprobs=[], choices=[], cached_tokens=0, kv_caches=[],
                    block_ids=[], ready=None)


def start(t: ConsumerTable, rid: str, block_ids: list[int], num_tokens: int):
    return t.start(rid, block_ids, num_tokens, [], 0, LINK)


def test_unclaimed_reservations_count_until_claimed_finished_or_dropped():
    t = ProducerTable()
    with t.lock:
        assert t.reserve("a", 3, 5, now=0.0, lease_s=10) and t.reserve("b", 2, 5, now=0.0, lease_s=10)
        assert not t.reserve("c", 1, 5, now=0.0, lease_s=10)  # 3 + 2 held for nobody
        pull(t, "a", deadline=10.0)  # claimed: no longer unclaimed
        assert t.reserve("c", 3, 5, now=0.0, lease_s=10)
        t.drop("c", "discarded")
        assert t.records["c"].state is S.DROPPED
        assert t.reserve("d", 3, 5, now=0.0, lease_s=10)  # a dropped reservation holds nothing
        assert t.reserve("e", 5, 5, now=11.0, lease_s=10)  # b and d ran out unfinished
        assert t.reserve("a", 99, 5, now=11.0, lease_s=10)  # pulled already: not unclaimed KV


def test_producer_record_from_hand_over_to_release():
    t = ProducerTable()
    t.hand_over("x")  # the scheduler side, before the worker's finish
    assert t.state("x") is S.HANDED_OVER
    with t.lock:
        req = pull(t, "x", deadline=5.0)
        assert req.state is S.HANDED_OVER and finish(t, "x", deadline=9.0) is req and req.state is S.HELD
        t.sending(req)
        t.done_sent(req, deadline=20.0)
        assert req.state is S.AWAITING_ACK and t.ack("x") is req and req.state is S.RELEASED
        assert t.poll_freeable() == {"x"} and "x" not in t.records  # acknowledged: forgotten


def test_a_pinging_consumer_renews_only_its_pairs_ack_leases():
    """DONE is out but its bytes may still be on a slow wire: the consumer's ping (it is alive and
    bounds its own wait) moves the ACK lease of its pair's records on, and no other record's."""
    t = ProducerTable()
    mine, other = object(), object()
    with t.lock:
        for rid, link, state in (("a", mine, "awaiting"), ("b", other, "awaiting"), ("c", mine, "held")):
            req = pull(t, rid, deadline=5.0, link=link)
            finish(t, rid, deadline=9.0)
            if state == "awaiting":
                t.sending(req)
                t.done_sent(req, deadline=20.0)
        t.renew_acks(mine, deadline=50.0)
        assert [t.records[r].deadline for r in ("a", "b", "c")] == [50.0, 20.0, 9.0]
        t.renew_acks(mine, deadline=30.0)  # never shortened
        assert t.records["a"].deadline == 50.0


def test_producer_drop_while_prefill_runs_frees_the_blocks_at_finish_and_keeps_the_reason():
    t = ProducerTable()
    with t.lock:
        pull(t, "x", deadline=5.0)
        t.drop("x", "aborted by the consumer")
        assert t.records["x"].state is S.DROPPED and finish(t, "x", deadline=9.0) is None
        assert t.poll_freeable() == {"x"}
        assert t.records["x"].state is S.DROPPED and t.records["x"].why == "aborted by the consumer"
        assert t.drop("x", "again") is None  # dropped once


def test_consumer_abort_wins_over_a_landing_and_holds_until_the_link_stopped():
    t = ConsumerTable()
    t.load_pending("x")
    t.issue("x")
    rec = start(t, "x", [1, 2], 8)
    assert rec is not None and t.state("x") is C.QUEUED
    t.pull_sent(rec)
    assert t.abort("x") and t.state("x") is C.ABORTING  # the scheduler side decides
    assert t.stop("x") is LINK  # the worker issues it: the link still has to say it stopped
    assert not t.finish(rec, C.LANDED, first_token=7)  # a landing after the abort is ignored
    assert t.poll_finished() == ({}, {}) and t.poll_aborted() == set()
    t.abort_stopped("x")
    assert t.poll_aborted() == {"x"} and t.state("x") is None


def test_consumer_landed_extras_wait_one_poll_and_pending_loads_are_dropped_at_once():
    t = ConsumerTable()
    rec = start(t, "x", [1], 4)
    t.pull_sent(rec)
    assert t.finish(rec, C.LANDED, first_token=7, cached_tokens=3)
    assert t.poll_finished() == ({"x": 7}, {}) and t.value("x") == "unknown"
    assert t.take_landed({"x"})["x"].cached_tokens == 3 and t.state("x") is None
    t.load_pending("y")
    assert t.cancel_pending("y") and not t.abort("y") and t.state("y") is None


def test_a_planned_record_is_filled_in_place_and_reports_fill_it_too():
    """The record the scheduler planned is the one the load, the link's reports and DONE fill:
    nothing holds a second copy of it."""
    t = ConsumerTable()
    t.load_pending("x")
    t.issue("x")
    with t.lock:
        planned = t._records["x"]
    rec = start(t, "x", [4, 5], 20)
    assert rec is planned and rec.block_ids == [4, 5] and rec.num_tokens == 20 and rec.link is LINK
    t.pull_sent(rec)
    t.first_byte(rec)
    t.layers_landed(rec, [0, 1], 512, {0: 11, 1: 12})
    assert (rec.state, rec.layers, rec.nbytes, rec.checksums) == (C.RECEIVING, {0, 1}, 512, {0: 11, 1: 12})
    assert rec.first_byte is not None and rec.last_landed is not None
    assert t.retry(rec) and not t.retry(rec)  # asked again on a new pair once


@pytest.mark.parametrize("module", [consumer_table, producer_table])
def test_every_state_has_its_moves_and_an_illegal_move_raises(module):
    """The moves map names every state; a move it does not list is a bug and raises."""
    states = set(module.ConsumerState if module is consumer_table else module.ProducerState)
    assert set(module.MOVES) == states | {None}
    assert set().union(*module.MOVES.values()) <= states


def test_illegal_moves_raise_on_both_sides():
    c = ConsumerTable()
    c.load_pending("x")
    with pytest.raises(IllegalMove, match="LOAD_PENDING -> LANDED"), c.lock:
        c._move(c._records["x"], C.LANDED)  # DONE for a load never sent
    p = ProducerTable()
    p.hand_over("y")
    with pytest.raises(IllegalMove, match="HANDED_OVER -> AWAITING_ACK"), p.lock:
        p._move(p.records["y"], S.AWAITING_ACK)
    with p.lock:
        assert p.ack("y") is None  # nothing was sent: an ACK moves nothing


def _state_writes(node: ast.AST, func: str = "<module>"):
    """(enclosing function, line) of each assignment to an attribute named ``state``."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _state_writes(child, child.name)
            continue
        targets = child.targets if isinstance(child, ast.Assign) else \
            [child.target] if isinstance(child, ast.AugAssign | ast.AnnAssign) else []
        if any(isinstance(e, ast.Attribute) and e.attr == "state" and isinstance(e.ctx, ast.Store)
               for t in targets for e in ast.walk(t)):
            yield func, child.lineno
        yield from _state_writes(child, func)


def test_a_records_state_is_written_only_by_its_tables_move():
    """Every module of every package is read: the only statements that write a ``.state`` are the
    two tables' ``_move``, so no thread changes a transfer's state outside the map of moves."""
    root = Path(__file__).resolve().parents[3]
    writers = {(path.relative_to(root).as_posix(), func)
               for package in ("common", "prefill_node", "decode_node", "proxy", "pdserve")
               for path in sorted((root / package).rglob("*.py"))
               for func, _ in _state_writes(ast.parse(path.read_text()))}
    assert writers == {("common/kv_transfer/producer_table.py", "_move"),
                       ("common/kv_transfer/consumer_table.py", "_move")}
