from __future__ import annotations

import pytest

from common.engine.kv_connector import FinishedTransfers
from common.kv_transfer.tp import HeadRange, KVOutputAggregator, TpKVTopology


def test_aggregator_waits_for_every_worker():
    agg = KVOutputAggregator(world_size=2)
    out = agg.aggregate([FinishedTransfers(done_sending={"a"}, done_recving={"x": 5}), FinishedTransfers()])
    assert out.done_sending == set() and out.done_recving == {}
    out = agg.aggregate([FinishedTransfers(), FinishedTransfers(done_sending={"a"}, done_recving={"x": 5})])
    assert out.done_sending == {"a"} and out.done_recving == {"x": 5}


def test_aggregator_fails_on_first_failure_and_swallows_the_rest():
    agg = KVOutputAggregator(world_size=3)
    out = agg.aggregate([FinishedTransfers(done_recving={"r": 1}), FinishedTransfers(failed_recving={"r": "boom"}),
                         FinishedTransfers()])
    assert out.failed_recving == {"r": "boom"} and out.done_recving == {}
    out = agg.aggregate([FinishedTransfers(), FinishedTransfers(), FinishedTransfers(done_recving={"r": 1})])
    assert out == FinishedTransfers()
    out = agg.aggregate([FinishedTransfers(done_recving={"r": 2})] * 3)  # a later request reusing the id
    assert out.done_recving == {"r": 2}


def test_same_tp_maps_rank_to_rank():
    for rank in range(4):
        topo = TpKVTopology(tp_rank=rank, tp_size=4, remote_tp_size=4, total_num_kv_heads=8)
        assert topo.remote_ranges() == [HeadRange(rank, 2 * rank, 2 * rank + 2)]


def test_local_tp_larger_reads_a_slice_of_one_remote_rank():
    # D has TP 4, P has TP 2, 8 heads: D rank 3 holds heads 6-7, which P rank 1 holds (4-7).
    topo = TpKVTopology(tp_rank=3, tp_size=4, remote_tp_size=2, total_num_kv_heads=8)
    assert topo.tp_ratio == 2 and topo.remote_ranges() == [HeadRange(1, 6, 8)]


def test_local_tp_smaller_reads_from_several_remote_ranks():
    topo = TpKVTopology(tp_rank=1, tp_size=2, remote_tp_size=4, total_num_kv_heads=8)
    assert topo.remote_ranges() == [HeadRange(2, 4, 6), HeadRange(3, 6, 8)]
    assert topo.remote_ranks() == [2, 3]


def test_replicated_heads_spread_over_holders():
    # 2 KV heads, remote TP 4: each head lives on 2 remote ranks.
    ranks = [TpKVTopology(tp_rank=r, tp_size=2, remote_tp_size=4, total_num_kv_heads=2).remote_ranks()
             for r in range(2)]
    assert ranks == [[0], [3]]
    topo = TpKVTopology(tp_rank=3, tp_size=4, remote_tp_size=1, total_num_kv_heads=2)
    assert topo.remote_ranges() == [HeadRange(0, 1, 2)]


def test_invalid_sizes_raise():
    with pytest.raises(ValueError):
        TpKVTopology(tp_rank=0, tp_size=3, remote_tp_size=2, total_num_kv_heads=8)
    with pytest.raises(ValueError):
        TpKVTopology(tp_rank=2, tp_size=2, remote_tp_size=2, total_num_kv_heads=8)
