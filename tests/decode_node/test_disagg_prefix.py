"""Prefix caching across a real prefill daemon and decode daemon.

A repeated prefix is computed once by the prefill daemon and moved once: the decode
daemon asks only for the blocks its own cache lacks, so ``kv_transfer_bytes_total`` grows
by exactly those blocks. Tokens always equal a colocated node without prefix caching, in
both dispatch orders; a decode daemon whose cached blocks were evicted (or that caches
nothing) gets the whole prompt's KV, cached blocks of the prefill daemon included.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from disagg_client import disaggregated, post

from helpers.cluster import all_ready, metric, start, wait_idle

BLOCK = 16
# the embedded model: 4 layers x (K and V) x 2 KV heads x head_dim 64 x fp32, per token
BYTES_PER_BLOCK = 4 * 2 * 2 * 64 * 4 * BLOCK
ENGINE_ARGS = ("--max-num-batched-tokens", "64", "--block-size", str(BLOCK))


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory):
    tmp: Path = tmp_path_factory.mktemp("disagg-prefix")
    specs = {
        "both": ("both", "--no-enable-prefix-caching"),  # the reference: no caching anywhere
        "prefill": ("prefill",),
        "decode": ("decode",),
        # 24 blocks: the next requests evict what an earlier one cached
        "small_decode": ("decode", "--num-kv-blocks", "24"),
        "plain_decode": ("decode", "--no-enable-prefix-caching"),
    }
    started = {name: start(role, tmp, *ENGINE_ARGS, *args, name=name, wait=False)
               for name, (role, *args) in specs.items()}
    with all_ready(started):  # loaded together, stopped together
        yield started


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 256) for _ in range(n)]


def _body(prompt: list[int], max_tokens: int = 8) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


def _colocated(both, body: dict) -> tuple[str, int]:
    r = post(both.url, "/v1/completions", body)
    assert r.status_code == 200, r.text
    data = r.json()
    return data["choices"][0]["text"], data["usage"]["completion_tokens"]


def _received(decode) -> float:
    return metric(decode.url, "pdserve:kv_transfer_bytes_total")


def _served(nodes: dict, decode: str, body: dict, order: str) -> float:
    """Serve ``body`` through prefill -> ``decode``; assert colocated parity; the bytes moved."""
    before = _received(nodes[decode])
    got = disaggregated(nodes["prefill"], nodes[decode], "/v1/completions", body, order)
    assert got == _colocated(nodes["both"], body)
    return _received(nodes[decode]) - before


@pytest.mark.parametrize("order", ["concurrent", "prefill_first"])
def test_multi_turn_moves_only_what_decode_lacks(nodes: dict, order: str) -> None:
    seed = 1 if order == "concurrent" else 2
    system = _prompt(100, seed)  # 6 full blocks + 4 tokens
    turn1 = system + _prompt(30, seed + 10)  # 130 tokens: 9 blocks
    assert _served(nodes, "decode", _body(turn1), order) == 9 * BYTES_PER_BLOCK
    p_hits = metric(nodes["prefill"].url, "pdserve:prefix_cache_hits_total")
    turn2 = turn1 + _prompt(40, seed + 20)  # 170 tokens: 11 blocks, the first 8 cached on both
    assert _served(nodes, "decode", _body(turn2), order) == 3 * BYTES_PER_BLOCK
    assert metric(nodes["prefill"].url, "pdserve:prefix_cache_hits_total") - p_hits == 8 * BLOCK
    # the same prompt again: all but the block holding its last token is cached, so the decode
    # node computes that block itself and pulls nothing (tests/decode_node/test_decode_override.py)
    assert _served(nodes, "decode", _body(turn2), order) == 0
    assert metric(nodes["decode"].url, "pdserve:prefix_cache_hits_total") > 0
    assert metric(nodes["decode"].url, "pdserve:prefix_cache_queries_total") >= 130 + 170 * 2


def test_decode_without_the_blocks_gets_everything(nodes: dict) -> None:
    prompt = _prompt(90, 3)  # 6 blocks
    _served(nodes, "decode", _body(prompt), "concurrent")  # now cached on the prefill daemon
    # a decode daemon that caches nothing asks from block 0: the prefill daemon sends its cached blocks too
    assert _served(nodes, "plain_decode", _body(prompt), "concurrent") == 6 * BYTES_PER_BLOCK
    assert _served(nodes, "plain_decode", _body(prompt), "prefill_first") == 6 * BYTES_PER_BLOCK


def test_evicted_blocks_fall_back_to_a_full_transfer(nodes: dict) -> None:
    prompt = _prompt(150, 4)  # 10 blocks of the small decode daemon's 24
    assert _served(nodes, "small_decode", _body(prompt), "concurrent") == 10 * BYTES_PER_BLOCK
    for i in range(3):  # three other 150-token prompts: the least recently freed blocks go first
        _served(nodes, "small_decode", _body(_prompt(150, 40 + i)), "concurrent")
    assert _served(nodes, "small_decode", _body(prompt), "prefill_first") == 10 * BYTES_PER_BLOCK


def test_concurrent_requests_sharing_a_prefix(nodes: dict) -> None:
    from concurrent.futures import ThreadPoolExecutor

    system = _prompt(64, 5)
    bodies = [_body(system + _prompt(10 + 7 * i, 50 + i), max_tokens=6) for i in range(8)]
    expected = [_colocated(nodes["both"], b) for b in bodies]
    orders = ["concurrent", "prefill_first"]
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda ib: disaggregated(nodes["prefill"], nodes["decode"], "/v1/completions",
                                                     ib[1], orders[ib[0] % 2]), enumerate(bodies)))
    assert got == expected
    for name in ("prefill", "decode"):
        wait_idle(nodes[name].url)  # every block is free again (cached ones count as free)
