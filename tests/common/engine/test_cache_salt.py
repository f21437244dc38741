"""``cache_salt``: only requests with the same salt share prefix-cache blocks, on a colocated
engine and on a decode engine's partial-transfer lookup; the tokens never change."""

from __future__ import annotations

import pytest

from common.engine.block_hash import extend_hashes, root_hash, salted_root
from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams, SamplingParamsError
from helpers.fake_kv_worker import RecordingWorker, consumer, producer
from test_prefix_cache_engine import check_blocks, engine, tokens


def greedy(salt: str | None) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, cache_salt=salt)


def chain(tokens_: list[int], salt: str | None) -> list[bytes]:
    out: list[bytes] = []
    extend_hashes(out, salted_root(root_hash("m", 4), salt), lambda a, b: tokens_[a:b], 4, len(tokens_) // 4)
    return out


def test_the_salt_changes_every_block_name():
    t = list(range(12))
    plain, a, b = chain(t, None), chain(t, "tenant-a"), chain(t, "tenant-b")
    assert chain(t, "tenant-a") == a  # the same salt names the same blocks
    assert all(x != y for x, y in zip(a, plain)) and all(x != y for x, y in zip(a, b))
    assert plain == chain(t, None) and salted_root(b"r", None) == b"r"  # no salt: as before


@pytest.mark.parametrize("salt", ["", "x" * 257])
def test_salt_bounds(salt):
    with pytest.raises(SamplingParamsError) as err:
        greedy(salt).validate()
    assert err.value.param == "cache_salt"
    greedy("x" * 256).validate()


def hits_after(e: LLMEngine, rid: str, prompt: list[int], salt: str | None) -> tuple[int, list[int]]:
    """Prefix-cache hits (tokens) one request added, and its tokens."""
    before = e.stats().prefix_cache_hits
    e.add_request(rid, prompt, greedy(salt))
    got = []
    while e.has_unfinished_requests():
        got += [t for o in e.step() for t in o.new_token_ids]
        check_blocks(e)
    return e.stats().prefix_cache_hits - before, got


def test_only_the_same_salt_shares_blocks(checkpoint_dir):
    e = engine(checkpoint_dir("qwen3"), True, num_kv_blocks=32)
    prompt = tokens(70, 11)  # 4 full blocks of 16, then 6 tokens
    assert hits_after(e, "a1", prompt, "a")[0] == 0
    other, got_b = hits_after(e, "b1", prompt, "b")
    unsalted, got_none = hits_after(e, "n1", prompt, None)
    same, got_a = hits_after(e, "a2", prompt, "a")
    assert other == 0 and unsalted == 0  # neither another salt nor no salt sees tenant a's blocks
    assert same == 64
    assert got_a == got_b == got_none  # the salt names blocks; it never changes what they hold
    assert hits_after(e, "n2", prompt, None)[0] == 64  # unsalted requests still share among themselves


def test_decode_side_asks_for_every_block_another_salt_cached(checkpoint_dir):
    """The consumer's lookup is salted too: a prompt its cache holds under another salt is
    asked for whole (first_block 0), the same salt only for the blocks it lacks."""
    path = checkpoint_dir("qwen3")
    first = tokens(70, 12)  # 4 full blocks of 16, then 6 tokens
    # shares those 4 blocks; 36 more tokens, so the decode engine still asks (a remainder within
    # one block it would compute itself: tests/decode_node/test_decode_override.py)
    longer = first[:64] + tokens(36, 13)
    want = dict(zip((70, 100), engine(path, False, num_kv_blocks=32).generate([first, longer], greedy(None))))
    p = LLMEngine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32), producer())
    dw = RecordingWorker()
    d = LLMEngine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32), consumer(dw))
    cases = (("a", first, "s1", 0), ("b", first, "s2", 0), ("c", longer, "s1", 4), ("d", longer, None, 0))
    for rid, prompt, salt, want_first in cases:
        p.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=1, cache_salt=salt),
                      kv_transfer_params={"decode_addr": "127.0.0.1:1"})
        [first_token] = [t for o in p.step() for t in o.new_token_ids]
        p_table = p.scheduler.blocks_lent[rid].block_table
        d.add_request(rid, prompt, greedy(salt), kv_transfer_params={"prefill_addr": "127.0.0.1:2"})
        d.step()
        first, blocks = dw.loads[rid]
        assert first == want_first and len(blocks) == len(p_table) - first
        for src, dst in zip(p.kv_caches, d.kv_caches):
            dst[:, blocks] = src[:, p_table[first:]]
        dw.land(rid, first_token)
        got = []
        while d.has_unfinished_requests():
            got += [t for o in d.step() for t in o.new_token_ids]
            check_blocks(d)
        assert got == want[len(prompt)]
