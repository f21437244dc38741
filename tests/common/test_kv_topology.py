"""KV head routing between prefill and decode nodes of different TP sizes."""

from __future__ import annotations

import itertools

import pytest
import torch

from common.kv_topology import (
    KVTopology,
    Route,
    TopologyMismatch,
    plan,
    routes_from,
    routes_to,
)
from common.model.config import ModelConfig
from common.model.tensor_parallel import TPShard, shard_sizes

SIZES = (1, 2, 4, 8)


def _valid(kv: int, tp: int) -> bool:
    return kv % tp == 0 or tp % kv == 0


COMBOS = [
    (kv, a, b)
    for kv, a, b in itertools.product(SIZES, SIZES, SIZES)
    if _valid(kv, a) and _valid(kv, b)
]


def _shard(full: torch.Tensor, kv: int, tp: int, rank: int) -> torch.Tensor:
    """The rank's cache, sliced the way shard_sizes places its KV heads."""
    n = max(1, kv // tp)
    start = rank * kv // tp
    return full[:, :, :, start:start + n].clone()


def test_combos_cover_all_ratios():
    assert any(a == b for _, a, b in COMBOS)
    assert any(a > b for _, a, b in COMBOS)
    assert any(a < b for _, a, b in COMBOS)
    assert any(a > kv for kv, a, _ in COMBOS) and any(b > kv for kv, _, b in COMBOS)


def _cfg(kv: int, tp: int) -> ModelConfig:
    """A small ModelConfig with ``kv`` KV heads that shards over ``tp`` ranks."""
    return ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=64 * tp, hidden_size=64,
        intermediate_size=64 * tp, num_layers=1, num_heads=kv * 8, num_kv_heads=kv, head_dim=4,
        rms_norm_eps=1e-6, rope_theta=10000.0, rope_scaling=None, max_position_embeddings=128,
        tie_word_embeddings=False, attention_bias=False, qk_norm=False, eos_token_ids=[0],
        bos_token_id=None,
    )


@pytest.mark.parametrize("kv,tp", [(kv, tp) for kv in SIZES for tp in SIZES if _valid(kv, tp)])
def test_heads_of_matches_shard_sizes(kv, tp):
    topo = KVTopology(tp, kv)
    for rank in range(tp):
        s = shard_sizes(_cfg(kv, tp), TPShard(rank=rank, size=tp))
        held = topo.heads_of(rank)
        assert held == range(s.kv_start, s.kv_start + s.num_kv_heads)
        for h in held:
            assert rank in topo.holders_of(h)
    for h in range(kv):
        assert list(topo.holders_of(h)) == [r for r in range(tp) if h in topo.heads_of(r)]


@pytest.mark.parametrize("kv,a,b", COMBOS)
def test_plan_covers_each_destination_head_once(kv, a, b):
    src, dst = KVTopology(a, kv), KVTopology(b, kv)
    routes = plan(src, dst)
    assert all(isinstance(r, Route) for r in routes)
    for d in range(b):
        got = [h for r in routes_to(d, routes) for h in r.heads]
        assert sorted(got) == list(dst.heads_of(d))
        dst_start = dst.heads_of(d).start
        for r in routes_to(d, routes):
            assert r.dst_rank == d and 0 <= r.src_rank < a
            held = src.heads_of(r.src_rank)
            assert len(range(held.stop)[r.src_heads]) == len(r.heads)
            assert len(range(dst.heads_of(d).stop)[r.dst_heads]) == len(r.heads)
            # local -> global through each side's first head gives back `heads`
            assert range(held.start + r.src_heads.start, held.start + r.src_heads.stop) == r.heads
            assert range(dst_start + r.dst_heads.start, dst_start + r.dst_heads.stop) == r.heads
            assert 0 <= r.src_heads.start < r.src_heads.stop <= len(held)
            assert set(r.heads) <= set(held)
        # minimal: one route per source rank feeding this destination
        srcs = [r.src_rank for r in routes_to(d, routes)]
        assert len(srcs) == len(set(srcs))
    by_src = [routes_from(s, routes) for s in range(a)]
    assert sum(len(x) for x in by_src) == len(routes)
    assert all(r.src_rank == s for s, x in enumerate(by_src) for r in x)
    if a == b:  # identity when sizes match
        assert all(r.src_rank == r.dst_rank for r in routes)


@pytest.mark.parametrize("kv,a,b", COMBOS)
def test_plan_moves_the_right_numbers(kv, a, b):
    gen = torch.Generator().manual_seed(kv * 100 + a * 10 + b)
    blocks, block_size, head_dim = 3, 4, 5
    full = torch.randn(2, blocks, block_size, kv, head_dim, generator=gen)
    src_caches = [_shard(full, kv, a, r) for r in range(a)]
    dst_caches = [torch.full_like(_shard(full, kv, b, r), float("nan")) for r in range(b)]
    for r in plan(KVTopology(a, kv), KVTopology(b, kv)):
        dst_caches[r.dst_rank][:, :, :, r.dst_heads] = src_caches[r.src_rank][:, :, :, r.src_heads]
    for rank, got in enumerate(dst_caches):
        assert torch.equal(got, _shard(full, kv, b, rank)), (kv, a, b, rank)


def test_replicated_source_spreads_over_replicas():
    # kv=2 at a=8: heads 0/1 each held by 4 source ranks; 8 destination ranks read 8 different ones
    routes = plan(KVTopology(8, 2), KVTopology(8, 2))
    assert sorted(r.src_rank for r in routes) == list(range(8))
    routes = plan(KVTopology(8, 2), KVTopology(2, 2))
    assert [(r.src_rank, r.dst_rank, r.heads) for r in routes] == [(0, 0, range(0, 1)), (5, 1, range(1, 2))]


def test_docstring_examples():
    r = plan(KVTopology(2, 8), KVTopology(4, 8))
    assert [(x.src_rank, x.dst_rank, x.src_heads, x.dst_heads) for x in r] == [
        (0, 0, slice(0, 2), slice(0, 2)), (0, 1, slice(2, 4), slice(0, 2)),
        (1, 2, slice(0, 2), slice(0, 2)), (1, 3, slice(2, 4), slice(0, 2)),
    ]
    r = plan(KVTopology(4, 8), KVTopology(1, 8))
    assert [(x.src_rank, x.dst_heads) for x in r] == [(i, slice(2 * i, 2 * i + 2)) for i in range(4)]
    r = plan(KVTopology(1, 2), KVTopology(4, 2))
    assert [(x.src_rank, x.dst_rank, x.src_heads) for x in r] == [
        (0, d, slice(d // 2, d // 2 + 1)) for d in range(4)]


def test_mismatched_total_heads():
    with pytest.raises(TopologyMismatch) as e:
        plan(KVTopology(2, 8), KVTopology(2, 4))
    assert "8" in str(e.value) and "4" in str(e.value)
    assert isinstance(e.value, ValueError)


@pytest.mark.parametrize("kv,a,b", [(6, 4, 2), (8, 2, 3), (3, 2, 1), (4, 1, 6)])
def test_invalid_split_raises(kv, a, b):
    with pytest.raises(TopologyMismatch, match="split is invalid"):
        plan(KVTopology(a, kv), KVTopology(b, kv))


def test_check():
    KVTopology(4, 8).check()
    KVTopology(8, 2).check()
    with pytest.raises(ValueError, match="6 KV heads"):
        KVTopology(4, 6).check()


def test_dict_roundtrip():
    for kv, tp in [(1, 1), (8, 4), (2, 64)]:
        t = KVTopology(tp, kv)
        d = t.to_dict()
        assert d == {"tp_size": tp, "num_kv_heads": kv}
        assert all(type(v) is int for v in d.values())
        assert KVTopology.from_dict(d) == t


@pytest.mark.parametrize("garbage", [
    None, "tp_size=2", [2, 8], 7,
    {}, {"tp_size": 2}, {"num_kv_heads": 8},
    {"tp_size": "2", "num_kv_heads": 8}, {"tp_size": 2, "num_kv_heads": "8"},
    {"tp_size": 2.0, "num_kv_heads": 8}, {"tp_size": True, "num_kv_heads": 8},
    {"tp_size": None, "num_kv_heads": 8}, {"tp_size": 2, "num_kv_heads": [8]},
    {"tp_size": 0, "num_kv_heads": 8}, {"tp_size": -2, "num_kv_heads": 8},
    {"tp_size": 2, "num_kv_heads": 0}, {"tp_size": 2, "num_kv_heads": -8},
    {"tp_size": 65, "num_kv_heads": 8}, {"tp_size": 2**64, "num_kv_heads": 8},
    {"tp_size": 2, "num_kv_heads": 10**12},
])
def test_from_dict_rejects_garbage(garbage):
    with pytest.raises(ValueError):
        KVTopology.from_dict(garbage)


def test_heads_of_rejects_bad_rank():
    t = KVTopology(4, 8)
    for rank in (-1, 4, "0", None):
        with pytest.raises(ValueError):
            t.heads_of(rank)
