"""KV tiers behind the prefix cache (common/engine/kv_tiers.py, kv_file_tier.py), in one process:
an evicted prefix comes back from a file (or host memory) with the same answer and fewer tokens
computed; a second engine reads the first one's directory; damaged files, a full disk and an
unusable directory cost recompute only; aborted loads leave nothing behind."""

from __future__ import annotations

import errno
import random
import time

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.kv_file_tier import BadBlockFile, FileTier, decode_block, encode_block
from common.engine.kv_tiers import MEDIUM_DISK, Found, KVTiers
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
# 256 tokens: two 100-token prompts evict a third's. Tiers load whatever they hold: the tiny model's
# prefill beats a file load, which --kv-tier-load auto would measure and skip
POOL = dict(device="cpu", num_kv_blocks=16, block_size=16)
TIERS = dict(POOL, kv_tier_load="always")


def prompts(n: int, length: int = 100, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 256) for _ in range(length)] for _ in range(n)]


def ask(e: LLMEngine, prompt: list[int], rid: str, timeout: float = 30.0,
        params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """One request alone: its tokens and its usage's cached tokens."""
    e.add_request(rid, prompt, params)
    tokens, cached = [], 0
    deadline = time.monotonic() + timeout
    while e.has_unfinished_requests():
        assert time.monotonic() < deadline, "request did not finish"
        for out in e.step():
            tokens += out.new_token_ids
            cached = out.num_cached_tokens
    return tokens, cached


def written(e: LLMEngine) -> None:
    assert e.kv_tiers.file.drain(10.0)


@pytest.fixture(scope="module")
def reference():
    """Each prompt's answer from an engine without tiers."""
    e = LLMEngine(EngineConfig(**POOL))
    return {tuple(p): ask(e, p, f"ref-{i}")[0] for i, p in enumerate(prompts(4))}


def test_block_file_round_trip_and_damage():
    kv = torch.randn(2, 2, 4, 1, 8)
    data = encode_block(kv)
    assert torch.equal(decode_block(data, tuple(kv.shape), kv.dtype), kv)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    for bad in (bytes(flipped), data[:-3], b"junk", data[:len(data) // 2]):
        with pytest.raises(BadBlockFile):
            decode_block(bad, tuple(kv.shape), kv.dtype)
    with pytest.raises(BadBlockFile):
        decode_block(data, (2, 2, 4, 2, 4), kv.dtype)  # same bytes, another layout


def test_evicted_prefix_comes_back_from_disk_and_a_second_engine_shares_it(tmp_path, reference):
    a = LLMEngine(EngineConfig(**TIERS, kv_disk_dir=str(tmp_path)))
    ps = prompts(4)
    for i, p in enumerate(ps):  # each one evicts an earlier one's blocks: they go to files
        assert ask(a, p, f"a{i}") == (reference[tuple(p)], 0)
    written(a)
    tokens, cached = ask(a, ps[0], "again")
    assert tokens == reference[tuple(ps[0])] and cached == 96  # 6 full blocks of 99 tokens
    disk = a.kv_tiers.stats()["disk"]
    assert disk["hits"] >= 6 and disk["errors"] == 0 and disk["blocks"] > 0
    written(a)
    b = LLMEngine(EngineConfig(**TIERS, kv_disk_dir=str(tmp_path)))  # another node, the same directory
    assert ask(b, ps[1], "b") == (reference[tuple(ps[1])], 96)
    assert b.kv_tiers.stats()["disk"]["hits"] == 6
    assert b.block_manager.num_free_blocks == b.block_manager.num_blocks


def test_damaged_files_are_recomputed_and_counted(tmp_path, reference):
    a = LLMEngine(EngineConfig(**TIERS, kv_disk_dir=str(tmp_path)))
    ps = prompts(4)
    for i, p in enumerate(ps):
        ask(a, p, f"a{i}")
    written(a)
    files = sorted((tmp_path / a.scheduler.cache_root.hex()).glob("*.kv"))
    assert files
    for f in files:  # one flipped byte each: the checksum catches it
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    b = LLMEngine(EngineConfig(**TIERS, kv_disk_dir=str(tmp_path)))
    tokens, cached = ask(b, ps[0], "b")
    assert tokens == reference[tuple(ps[0])] and cached == 0
    assert b.kv_tiers.stats()["disk"]["errors"] >= 1
    assert b.block_manager.num_free_blocks == b.block_manager.num_blocks


def test_full_disk_and_unusable_directory_serve_without_the_tier(tmp_path, monkeypatch, reference):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    e = LLMEngine(EngineConfig(**TIERS, kv_disk_dir=str(not_a_dir / "kv")))
    assert not e.kv_tiers.enabled and e.kv_tiers.stats()["disk"]["errors"] == 1
    p = prompts(1)[0]
    assert ask(e, p, "x") == (reference[tuple(p)], 0)

    def full(self, block_hash, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(FileTier, "_write", full)
    f = LLMEngine(EngineConfig(**TIERS, kv_disk_dir=str(tmp_path / "kv")))
    ps = prompts(4)
    for i, p in enumerate(ps + ps[:1]):
        assert ask(f, p, f"f{i}")[0] == reference[tuple(p)]
    written(f)
    disk = f.kv_tiers.stats()["disk"]
    assert disk["errors"] > 0 and disk["blocks"] == 0 and disk["hits"] == 0


def test_host_tier_on_cpu_and_demotion_to_disk(tmp_path, reference):
    block_bytes = 4 * 2 * 16 * 2 * 64 * 4  # layers x K,V x block x kv heads x head dim x float32
    e = LLMEngine(EngineConfig(**TIERS, kv_host_bytes=8 * block_bytes, kv_disk_dir=str(tmp_path)))
    ps = prompts(4)
    for i, p in enumerate(ps):
        ask(e, p, f"e{i}")
    written(e)
    stats = e.kv_tiers.stats()
    assert stats["host"]["blocks"] == 8 and stats["host"]["bytes"] == 8 * block_bytes
    assert stats["disk"]["blocks"] > 0  # what the host tier evicted went down
    for i, p in enumerate(ps[:2]):
        assert ask(e, p, f"again{i}") == (reference[tuple(p)], 96)
    stats = e.kv_tiers.stats()
    assert stats["host"]["hits"] > 0 and stats["disk"]["hits"] > 0


def test_ten_thousand_cancelled_loads_leak_nothing(tmp_path):
    caches = [torch.zeros(2, 4, 16, 2, 8) for _ in range(2)]
    file_tier = FileTier(str(tmp_path), "ns", 1 << 30, (2, 2, 16, 2, 8), torch.float32)
    assert file_tier.start()
    tiers = KVTiers(caches, 0, file_tier)
    kv = torch.randn(2, 2, 16, 2, 8)
    file_tier.put(b"h" * 16, kv)
    assert file_tier.drain(10.0)
    for i in range(10_000):
        assert tiers.start_load(f"r{i}", [b"h" * 16], Found(["DISK"], [None]), [i % 4]) is None
        tiers.cancel(f"r{i}")
        if i % 1000 == 0:
            tiers.poll()
    deadline = time.monotonic() + 30
    while (file_tier.pending_loads or file_tier._loaded) and time.monotonic() < deadline:
        tiers.poll()
        time.sleep(0.005)
    assert tiers.poll() == [] and tiers.pending_loads == 0
    assert not file_tier._cancelled and not file_tier._loaded and file_tier.pending_loads == 0
    assert tiers.start_load("last", [b"h" * 16], Found(["DISK"], [None]), [3]) is None  # the tier still serves
    deadline = time.monotonic() + 10
    while not (done := tiers.poll()) and time.monotonic() < deadline:
        time.sleep(0.002)
    assert done == [("last", 1)] and torch.equal(caches[1][:, 3], kv[1])
    file_tier.close()


def test_requests_aborted_while_loading_free_their_blocks(tmp_path):
    e = LLMEngine(EngineConfig(**TIERS, kv_disk_dir=str(tmp_path)))
    ps = prompts(4)
    for i, p in enumerate(ps):
        ask(e, p, f"a{i}")
    written(e)
    for round_ in range(20):
        e.add_request(f"x{round_}", ps[0], GREEDY)  # aborted loads cache nothing: it loads every time
        e.step()  # admitted: its prefix's blocks allocated, the file tier reading
        assert f"x{round_}" in e.scheduler.loading
        e.abort_request(f"x{round_}")
        e.step()
    assert not e.scheduler.loading and e.kv_tiers.pending_loads == 0
    assert e.block_manager.num_free_blocks == e.block_manager.num_blocks


def one_block_on_disk(tmp_path) -> tuple[list[torch.Tensor], FileTier, KVTiers]:
    """A one-layer pool of 4 blocks and a file tier holding block ``b"h" * 16``."""
    caches = [torch.zeros(2, 4, 16, 2, 8)]
    file_tier = FileTier(str(tmp_path), "ns", 1 << 30, (1, 2, 16, 2, 8), torch.float32)
    assert file_tier.start()
    tiers = KVTiers(caches, 0, file_tier)
    file_tier.put(b"h" * 16, torch.randn(1, 2, 16, 2, 8))
    assert file_tier.drain(10.0)
    return caches, file_tier, tiers


def test_a_file_tier_slower_than_prefill_is_skipped_but_measured_again(tmp_path):
    caches, file_tier, tiers = one_block_on_disk(tmp_path)
    assert len(tiers.lookup([b"h" * 16])) == 1  # nothing measured yet: load
    tiers.prefill_tokens_per_s = lambda: 16_000.0  # a block's 16 tokens in 1 ms
    tiers.s_per_block[MEDIUM_DISK] = 0.0005
    assert len(tiers.lookup([b"h" * 16])) == 1
    tiers.s_per_block[MEDIUM_DISK] = 0.002  # loading costs more than computing
    found = [len(tiers.lookup([b"h" * 16])) for _ in range(2 * 16)]
    assert found.count(1) == 2 and found.count(0) == 30  # only the exploring lookups load
    file_tier.close()


def test_tier_changes_reach_the_kv_events_with_their_medium(tmp_path):
    e = LLMEngine(EngineConfig(**TIERS, kv_disk_dir=str(tmp_path)))
    events = []
    e.block_manager.events = events.append
    for i, p in enumerate(prompts(3)):
        ask(e, p, f"e{i}")
    written(e)
    while e.has_schedulable_work():  # files written since the last step are news: a step sends them out
        e.step()
    disk = [ev for ev in events if getattr(ev, "medium", None) == "DISK"]
    assert disk and all(type(ev).__name__ == "BlockStored" for ev in disk)
    assert {ev.block_hashes[0] for ev in disk} == set(e.kv_tiers.file._files)
    assert not e.has_schedulable_work()


def test_a_hung_load_is_given_up_and_its_late_result_dropped(tmp_path, monkeypatch):
    import threading

    from common.engine import kv_tiers

    caches, file_tier, tiers = one_block_on_disk(tmp_path)
    volume = threading.Event()  # a hung volume: reads wait until it is set
    read = FileTier._read
    monkeypatch.setattr(FileTier, "_read", lambda self, h: volume.wait() and read(self, h))
    monkeypatch.setattr(kv_tiers, "LOAD_TIMEOUT_S", 0.05)
    assert tiers.start_load("r", [b"h" * 16], Found(["DISK"], [None]), [1]) is None
    deadline = time.monotonic() + 10
    while not (done := tiers.poll()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done == [("r", 0)] and tiers.pending_loads == 0 and tiers.stats()["disk"]["errors"] == 1
    volume.set()
    assert wait_drained(file_tier) and tiers.poll() == [] and not file_tier._cancelled
    assert torch.count_nonzero(caches[0][:, 1]) == 0  # nothing landed in the block given up
    file_tier.close()


def wait_drained(file_tier: FileTier, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while (file_tier.pending_loads or file_tier._loaded or file_tier._cancelled) and time.monotonic() < deadline:
        file_tier.take_loaded()
        time.sleep(0.005)
    return not (file_tier.pending_loads or file_tier._loaded or file_tier._cancelled)


def test_a_decode_node_loads_its_prefix_from_the_tiers_and_asks_the_peer_for_the_rest(tmp_path, reference):
    """A decode engine (consumer) whose pool evicted a conversation's first turn finds it in its file
    tier: it loads those blocks, then asks the prefill engine only for the blocks after them."""
    from helpers.fake_kv_worker import RecordingWorker, consumer, producer

    first = prompts(1)[0]  # 6 full blocks
    second = first + prompts(1, length=40, seed=9)[0]  # 8 full blocks, the first 6 shared
    expected = LLMEngine(EngineConfig(**POOL)).generate([first, second], GREEDY)
    p = LLMEngine(EngineConfig(**POOL), producer())
    dw = RecordingWorker()
    d = LLMEngine(EngineConfig(**TIERS, kv_disk_dir=str(tmp_path), kv_offload_on_finish=True), consumer(dw))

    def remote(rid: str, prompt: list[int]) -> tuple[list[int], int]:
        p.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1), kv_transfer_params={"decode_addr": "x:1"})
        [first_token] = [t for o in p.step() for t in o.new_token_ids]
        p_table = p.scheduler.blocks_lent[rid].block_table
        d.add_request(rid, prompt, GREEDY, kv_transfer_params={"prefill_addr": "x:2"})
        got: list[int] = []
        deadline = time.monotonic() + 30
        while rid not in dw.loads:  # via the tiers' loader when they hold its prefix
            assert time.monotonic() < deadline
            got += [t for o in d.step() for t in o.new_token_ids]
        first_block, blocks = dw.loads[rid]
        for src, dst in zip(p.kv_caches, d.kv_caches):
            dst[:, blocks] = src[:, p_table[first_block:]]
        dw.land(rid, first_token)
        while d.has_unfinished_requests():
            got += [t for o in d.step() for t in o.new_token_ids]
        p.abort_request(rid)
        p.step()
        return got, first_block

    assert remote("a", first) == (expected[0], 0)
    written(d)
    for i, filler in enumerate(prompts(3, seed=5)):  # local prompts push "a"'s blocks out of d's pool
        ask(d, filler, f"filler{i}")
    assert remote("b", second) == (expected[1], 6)  # 6 blocks from d's files, 2 + the tail from p
    assert d.kv_tiers.stats()["disk"]["hits"] >= 6
    assert d.block_manager.num_free_blocks == d.block_manager.num_blocks


def test_host_tier_slab_round_trip_runs_and_leases():
    """The host tier's slab: blocks go down and come back bit-exact through runs of slots; when full,
    the oldest go (into the file tier when there is one); a slot a lookup handed out is not taken
    by the evictions that allocating its load's blocks causes."""
    from common.engine.kv_tiers import runs
    assert runs([3, 4, 5, 9, 10, 2]) == [(0, 3), (3, 5), (5, 6)] and runs([]) == []
    caches = [torch.randn(2, 12, 16, 2, 8) for _ in range(2)]
    block_bytes = 2 * 2 * 16 * 2 * 8 * 4
    tiers = KVTiers(caches, 4 * block_bytes, None)
    assert tiers.host.capacity == 4
    hashes = [bytes([i]) * 16 for i in range(6)]
    want = {h: torch.stack([c[:, b] for c in caches]).clone() for b, h in enumerate(hashes)}
    tiers.offload_many([0, 1, 2], hashes[:3])
    found = tiers.lookup(hashes[:3])
    assert found.mediums == ["CPU"] * 3 and found.kv == [0, 1, 2]
    # loading them needs pool blocks, whose eviction brings 3 more to a tier of 4: the leased slots stay
    tiers.offload_many([3, 4, 5], hashes[3:])
    assert sorted(tiers.host._slots.values()) == [0, 1, 2, 3]
    assert tiers.start_load("r", hashes[:3], found, [8, 9, 10]) == 3
    for h, b in zip(hashes[:3], [8, 9, 10]):
        assert torch.equal(torch.stack([c[:, b] for c in caches]), want[h])
    assert hashes[3] in tiers.host and hashes[4] not in tiers.host  # 4 and 5 found no free slot
    tiers.offload_many([4, 5], hashes[4:])  # no lease now: the oldest (hashes[0], [1]) go
    assert [h in tiers.host for h in hashes] == [False, False, True, True, True, True]
    found = tiers.lookup(hashes[2:6])
    assert tiers.start_load("s", hashes[2:6], found, [8, 9, 10, 11]) == 4
    for h, b in zip(hashes[2:6], [8, 9, 10, 11]):
        assert torch.equal(torch.stack([c[:, b] for c in caches]), want[h])
    assert tiers.stats()["host"]["blocks"] == 4 and tiers.stats()["host"]["bytes"] == 4 * block_bytes
