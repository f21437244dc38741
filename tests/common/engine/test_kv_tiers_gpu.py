"""The KV tiers on CUDA (bf16 KV, skipped without a GPU): a prefix evicted into the pinned host tier,
and one fetched from a peer engine, come back into the device pool with the answer the engine gives
when the prefix is still in its own pool, bit for bit (the bytes that land are those computed), and
every block is free afterwards."""

from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from test_kv_peer_tier import EnginePeer, params
from test_kv_tiers import ask, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

POOL = dict(device="cuda", num_kv_blocks=16, block_size=16)  # two 100-token prompts evict a third's


def pool_hit_answers(ps: list[list[int]]) -> dict[tuple[int, ...], list[int]]:
    """Each prompt's answer from an engine without tiers whose pool still holds the prompt's prefix
    (asked twice: the second answer reuses 96 cached tokens, as a tier hit does)."""
    e = LLMEngine(EngineConfig(device="cuda", num_kv_blocks=256, block_size=16))
    out = {}
    for i, p in enumerate(ps):
        ask(e, p, f"first-{i}")
        answer, cached = ask(e, p, f"again-{i}")
        assert cached == 96
        out[tuple(p)] = answer
    return out


def test_host_tier_on_cuda_brings_an_evicted_prefix_back_bit_for_bit():
    ps = prompts(4)
    reference = pool_hit_answers(ps)
    e = LLMEngine(EngineConfig(**POOL, kv_tier_load="always", kv_host_bytes=64 << 20))
    assert e.kv_tiers.pool_blocks is not None, "the engine's pool is not one allocation: a copy per layer"
    assert e.kv_tiers.host.slab.is_pinned()
    for i, p in enumerate(ps):
        ask(e, p, f"e{i}")
    for i, p in enumerate(ps[:2]):  # evicted from the pool by the two after them
        assert ask(e, p, f"back{i}") == (reference[tuple(p)], 96)
    stats = e.kv_tiers.stats()["host"]
    assert stats["hits"] >= 12 and stats["load_bytes_per_s"] > 0
    assert e.block_manager.num_free_blocks == 16 and e.kv_tiers.pending_loads == 0


def test_peer_tier_between_two_cuda_engines_bit_for_bit():
    ps = prompts(2, seed=5)
    reference = pool_hit_answers(ps)
    server = LLMEngine(EngineConfig(**POOL, kv_peer_fetch="on"))
    client = LLMEngine(EngineConfig(**POOL, kv_peer_fetch="on", kv_tier_load="always"))
    peer = EnginePeer(server, client)
    client.kv_tiers.peer = peer
    for i, p in enumerate(ps):
        ask(server, p, f"s{i}")
        assert ask(client, p, f"c{i}", params=params(peer_blocks=6)) == (reference[tuple(p)], 96)
    assert [n for _, _, n in peer.asked] == [6, 6]
    assert client.kv_tiers.stats()["peer"]["hits"] == 12
    assert client.block_manager.num_free_blocks == 16 and client.kv_tiers.pending_loads == 0
