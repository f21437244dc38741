"""The peer tier's engine half (common/engine/kv_tiers.py, scheduler, ``LLMEngine.peer_blocks``): an
engine given a hint that another engine holds a prompt's prefix loads the leading blocks that
land and computes the rest, with the answer of an engine that computed everything. The network
between them is replaced by a source that reads the serving engine's ``peer_blocks`` (the network
half: tests/common/kv_transfer/test_peer_fetch.py)."""

from __future__ import annotations

import math
import random

import torch

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from test_kv_tiers import ask as tier_ask

POOL = dict(device="cpu", num_kv_blocks=32, block_size=16)
PEER = "10.0.0.2:5557"


def prompt(length: int = 100, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 256) for _ in range(length)]


def params(peer_blocks: int | None = None) -> SamplingParams:
    p = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    p.kv_peer = (PEER, peer_blocks) if peer_blocks else None
    return p


def ask(e: LLMEngine, tokens: list[int], rid: str, p: SamplingParams) -> tuple[list[int], int]:
    return tier_ask(e, tokens, rid, params=p)


class EnginePeer:
    """A peer source that answers from ``server``'s pool at the next poll; ``limit`` cuts what lands
    (a peer that died mid-fetch), ``None`` answers never (one that hangs)."""

    def __init__(self, server: LLMEngine, client: LLMEngine) -> None:
        self.server, self.shape = server, client.kv_tiers.block_shape
        self.dtype = client.kv_caches[0].dtype
        self.limit: int | None = 1 << 30
        self.asked: list[tuple[str, str, int]] = []
        self.cancelled: list[str] = []
        self._ready: list[tuple[str, list[torch.Tensor]]] = []

    @property
    def has_news(self) -> bool:
        return bool(self._ready)

    def load(self, job: str, kv_addr: str, hashes: list[bytes]) -> None:
        self.asked.append((job, kv_addr, len(hashes)))
        if self.limit is None:
            return
        count, data = self.server.peer_blocks(hashes)
        count = min(count, self.limit)
        if not count:
            self._ready.append((job, []))
            return
        kv = torch.frombuffer(bytearray(data[:count * math.prod(self.shape) * self.dtype.itemsize]), dtype=self.dtype)
        self._ready.append((job, list(kv.view(count, *self.shape).unbind(0))))

    def cancel(self, job: str) -> None:
        self.cancelled.append(job)
        self._ready = [(j, t) for j, t in self._ready if j != job]

    def take_loaded(self) -> list[tuple[str, list[torch.Tensor]]]:
        ready, self._ready = self._ready, []
        return ready


def engines() -> tuple[LLMEngine, LLMEngine, EnginePeer]:
    server = LLMEngine(EngineConfig(**POOL, kv_peer_fetch="on"))
    client = LLMEngine(EngineConfig(**POOL, kv_peer_fetch="on", kv_tier_load="always"))
    peer = EnginePeer(server, client)
    client.kv_tiers.peer = peer
    return server, client, peer


def test_a_prefix_a_peer_holds_is_fetched_not_computed():
    server, client, peer = engines()
    tokens = prompt()
    reference, _ = ask(server, tokens, "a", params())  # computes and caches 6 full blocks
    got, cached = ask(client, tokens, "b", params(peer_blocks=6))
    assert got == reference
    assert cached == 6 * 16  # every full block but the one holding the last token came from the peer
    assert peer.asked == [("b", PEER, 6)]
    stats = client.kv_tiers.stats()["peer"]
    assert stats["hits"] == 6 and stats["misses"] == 0 and stats["errors"] == 0 and stats["load_bytes_per_s"] > 0
    again, cached = ask(client, tokens, "c", params(peer_blocks=6))  # now in its own pool: the peer is not asked
    assert again == reference and cached == 96 and len(peer.asked) == 1


def test_a_fetch_cut_short_computes_the_rest_with_the_same_answer():
    server, client, peer = engines()
    tokens = prompt(seed=1)
    reference, _ = ask(server, tokens, "a", params())
    peer.limit = 2  # the peer died after two blocks
    got, cached = ask(client, tokens, "b", params(peer_blocks=6))
    assert got == reference and cached == 2 * 16
    assert client.kv_tiers.stats()["peer"]["errors"] == 1 and client.kv_tiers.lost == 4
    assert client.kv_tiers.pending_loads == 0


def test_a_peer_that_holds_nothing_costs_only_the_compute():
    server, client, peer = engines()
    tokens = prompt(seed=2)
    reference, _ = ask(LLMEngine(EngineConfig(**POOL)), tokens, "ref", params())
    got, cached = ask(client, tokens, "b", params(peer_blocks=6))  # the server never saw this prompt
    assert got == reference and cached == 0
    assert client.kv_tiers.stats()["peer"]["misses"] == 6


def test_aborts_while_fetching_free_every_block_and_forget_the_fetch():
    server, client, peer = engines()
    tokens = prompt(seed=3)
    ask(server, tokens, "a", params())
    peer.limit = None  # never answers
    free = client.block_manager.num_free_blocks
    for i in range(50):
        client.add_request(f"r{i}", tokens, params(peer_blocks=6))
        client.step()
        assert client.scheduler.loading
        client.abort_request(f"r{i}")
        client.step()
    assert not client.has_unfinished_requests() and not client.scheduler.loading
    assert client.block_manager.num_free_blocks == free
    assert client.kv_tiers.pending_loads == 0 and len(peer.cancelled) == 50


def test_the_serving_engine_copies_only_the_leading_blocks_it_holds():
    server, _, _ = engines()
    tokens = prompt(seed=4)
    ask(server, tokens, "a", params())
    cached = server.block_manager.cached_hashes()  # in the order they were cached: the chain's
    assert len(cached) == 6
    count, data = server.peer_blocks(cached[:3] + [b"x" * 16] + cached[3:])
    assert count == 3 and len(data) == 3 * server.kv_tiers.block_bytes
    assert server.peer_blocks([b"x" * 16]) == (0, b"")
    assert server.block_manager.num_free_blocks == server.block_manager.num_blocks  # nothing held for the asker


def test_a_hint_is_ignored_without_the_peer_tier():
    e = LLMEngine(EngineConfig(**POOL))
    tokens = prompt(seed=5)
    reference, _ = ask(LLMEngine(EngineConfig(**POOL)), tokens, "ref", params())
    assert e.kv_tiers is None
    assert ask(e, tokens, "b", params(peer_blocks=6)) == (reference, 0)


def test_a_peer_serves_what_its_host_tier_keeps_after_its_pool():
    server = LLMEngine(EngineConfig(device="cpu", num_kv_blocks=8, block_size=16, kv_peer_fetch="on",
                                    kv_host_bytes=64 << 20))
    client = LLMEngine(EngineConfig(**POOL, kv_peer_fetch="on", kv_tier_load="always"))
    client.kv_tiers.peer = EnginePeer(server, client)
    tokens = prompt(seed=6)
    reference, _ = ask(server, tokens, "a", params())
    ask(server, prompt(seed=7), "evict", params())  # 8 blocks: the first prompt's go to the host tier
    hashes = chain(server, tokens)
    pooled = len(server.block_manager.cached_blocks(hashes))
    assert pooled < 6 and all(h in server.kv_tiers.host for h in hashes[pooled:])  # the rest: in the host tier
    count, _ = server.peer_blocks(hashes)
    assert count == 6 and server.kv_tiers.host.hits == 0  # served, not counted as the server's own hits
    assert server.kv_tiers.stats()["host"]["served"] == 6 - pooled
    got, cached = ask(client, tokens, "b", params(peer_blocks=6))
    assert got == reference and cached == 96


def chain(engine: LLMEngine, tokens: list[int]) -> list[bytes]:
    """The hashes of ``tokens``' full blocks but the last token's, as ``engine`` names them."""
    from common.engine.block_hash import extend_hashes, salted_root

    hashes: list[bytes] = []
    extend_hashes(hashes, salted_root(engine.scheduler.cache_root, None), lambda s, e: tokens[s:e], 16,
                  (len(tokens) - 1) // 16)
    return hashes


def test_a_peer_slower_than_prefill_is_skipped_but_measured_again_beside_a_file_tier(tmp_path):
    """One lookup in 16 tries a medium measured slower than computing, counted per lookup: with a file
    tier asked too, the peer is still tried once in 16, not on every other count."""
    from common.engine.kv_tiers import MEDIUM_DISK, MEDIUM_PEER

    e = LLMEngine(EngineConfig(**POOL, kv_peer_fetch="on", kv_disk_dir=str(tmp_path)))
    tiers = e.kv_tiers
    tiers.peer = EnginePeer(e, e)
    tiers.prefill_tokens_per_s = lambda: 16_000.0  # a block's 16 tokens in 1 ms
    tiers.s_per_block[MEDIUM_DISK] = tiers.s_per_block[MEDIUM_PEER] = 0.002  # both cost more than computing
    found = [len(tiers.lookup([bytes([i]) * 16], (PEER, 1))) for i in range(32)]
    assert found.count(1) == 2 and found.count(0) == 30  # only the exploring lookups ask the peer
    tiers.close()
