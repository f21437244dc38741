"""KV tiers across real processes (common/engine/kv_tiers.py): two nodes share one file tier, a
damaged file and an unwritable directory cost recompute only, and aborted requests leak no block.

One module-scoped set of colocated nodes, each with a 16-block pool (256 tokens) so four
100-token prompts evict each other: ``a`` and ``b`` share a directory (``a`` stores each prompt's
blocks as it finishes: the pool evicts a prompt's tail first, so its head would reach a file late); ``ref`` was given a
directory it cannot use (a path under a file), so it serves without a tier: its answers are the
reference."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from helpers.cluster import Proc, labelled, start, stop_all, wait_idle
from helpers.waiting import wait_until

POOL = ("--num-kv-blocks", "16", "--block-size", "16", "--kv-tier-load", "always")  # the tiny model's prefill beats a load
PROMPTS = [[random.Random(i).randrange(3, 256) for _ in range(100)] for i in range(6)]


@pytest.fixture(scope="module")
def nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tmp = tmp_path_factory.mktemp("kv_tiers")
    shared = tmp / "shared"
    (tmp / "file").write_text("not a directory")
    procs = {
        "a": start("both", tmp, *POOL, "--kv-disk-dir", str(shared), "--kv-offload-on-finish", name="a", wait=False),
        "b": start("both", tmp, *POOL, "--kv-disk-dir", str(shared), name="b", wait=False),
        "ref": start("both", tmp, *POOL, "--kv-disk-dir", str(tmp / "file" / "kv"), name="ref", wait=False),
    }
    try:
        for proc in procs.values():
            proc.wait_ready()
        yield {"shared": shared, **procs}
    finally:
        stop_all(procs.values())


def complete(proc: Proc, prompt: list[int]) -> tuple[str, int]:
    r = httpx.post(proc.url + "/v1/completions", timeout=60, json={
        "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def disk(proc: Proc, name: str) -> float:
    return labelled(proc.url, f"pdserve:kv_tier_{name}", tier="disk")


def test_unwritable_directory_starts_warns_and_serves(nodes: dict) -> None:
    ref: Proc = nodes["ref"]
    assert "KV file tier off" in ref.log.read_text()
    assert disk(ref, "errors_total") == 1
    assert complete(ref, PROMPTS[0])[1] == 0


def test_two_nodes_share_one_file_tier(nodes: dict) -> None:
    a, b, ref = nodes["a"], nodes["b"], nodes["ref"]
    for prompt in PROMPTS[:4]:
        assert complete(a, prompt)[0] == complete(ref, prompt)[0]
    wait_until(lambda: disk(a, "blocks") >= 24, timeout=20, what="a's prompts' blocks written")
    text, cached = complete(b, PROMPTS[0])  # b never saw it: its prefix comes from a's files
    assert cached == 96 and text == complete(ref, PROMPTS[0])[0]
    assert disk(b, "hits_total") == 6 and disk(b, "errors_total") == 0


def test_damaged_files_are_recomputed_with_the_same_answer(nodes: dict) -> None:
    b, ref = nodes["b"], nodes["ref"]
    files = list(Path(nodes["shared"]).glob("*/*.kv"))
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        data[-5] ^= 0xFF
        f.write_bytes(bytes(data))
    errors = disk(b, "errors_total")
    text, cached = complete(b, PROMPTS[1])  # b has not computed it; a's files for it are damaged
    assert cached == 0 and text == complete(ref, PROMPTS[1])[0]
    assert disk(b, "errors_total") > errors
    assert "checksum mismatch" in b.log.read_text()


def test_aborted_requests_leak_no_block(nodes: dict) -> None:
    a = nodes["a"]
    for prompt in PROMPTS[2:6]:  # fresh files for the prompts below, then evicted from the pool
        complete(a, prompt)
    for i in range(40):  # each one gone as soon as it started: some while their prefix loads
        with httpx.stream("POST", a.url + "/v1/completions", timeout=60, json={
                "prompt": PROMPTS[i % 4 + 2], "max_tokens": 50, "temperature": 0, "stream": True}) as r:
            assert r.status_code == 200
    wait_idle(a.url)
    assert complete(a, PROMPTS[5])[0] == complete(nodes["ref"], PROMPTS[5])[0]
