"""Prefill and decode daemons of tensor-parallel size 2: each rank moves its own KV heads to the
peer's same rank, and the answers are the colocated node's; a rank killed mid-transfer ends
the request once, and every surviving rank's blocks are freed.

The embedded model has 2 KV heads: at TP 2 each rank holds one, so rank 1's bytes are half the
KV and an answer that lost them would not be the colocated node's.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import torch
from disagg_client import disaggregated, post, prefill_body, read_stream

from common.kv_transfer.messages import Handshake, HandshakeOk, decode, encode
from common.kv_transfer.transport import Endpoint, open_pair
from common.model.config import ModelConfig
from common.model.embedded import ensure_embedded_model
from common.request_id import make_request_id
from helpers.cluster import Proc, metric, pd_cluster, start, stop_all, wait_idle
from helpers.procs import children, gone
from helpers.waiting import wait_for, wait_until
from helpers.zmq_peer import raw_dealer

TP = ("--tensor-parallel-size", "2")
TIMEOUT_S = 2.0
LEASE_S = 3.0
ARGS = ("--kv-timeout-s", str(TIMEOUT_S), "--kv-lease-s", str(LEASE_S), "--block-size", "16")
# a short prompt, one over several blocks, and one whose blocks end exactly at the prompt's end
PROMPTS = ["The quick brown fox", "def main():\n    import os\n    print(os.getcwd())\n" * 6, "x " * 64]


@pytest.fixture(scope="module")
def colocated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """The colocated node every cluster here is compared with (one for the module: the answers
    depend on the model and block size, not on who asks). Not waited for here: it loads while the
    cluster that asks for it does."""
    proc = start("both", tmp_path_factory.mktemp("tp-colocated"), "--block-size", "16", wait=False)
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, colocated: Proc):
    tmp = tmp_path_factory.mktemp("tp-disagg")
    # no prefix cache on D: every request must pull its KV (a cached prompt is computed there)
    with pd_cluster(tmp, node_args=(*TP, *ARGS, "--no-enable-prefix-caching"), colocated_args=None) as procs:
        colocated.wait_ready()
        yield tmp, {**procs, "both": colocated}


def _rank_bytes(url: str) -> dict[str, float]:
    """``pdserve:kv_rank_transfer_bytes_total`` by rank."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("pdserve:kv_rank_transfer_bytes_total{"):
            rank = line.split('rank="', 1)[1].split('"', 1)[0]
            out[rank] = float(line.rsplit(" ", 1)[1])
    return out


def _complete(url: str, prompt: str, **extra) -> dict:
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "logprobs": 1, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]


def test_tp2_to_tp2_through_the_proxy_gives_the_colocated_answers(cluster) -> None:
    _, procs = cluster
    before = {name: _rank_bytes(procs[name].url) for name in ("prefill", "decode")}
    for prompt in PROMPTS:
        got, want = _complete(procs["proxy"].url, prompt), _complete(procs["both"].url, prompt)
        assert got["text"] == want["text"]
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
    for name in ("prefill", "decode"):
        wait_idle(procs[name].url)
    # every rank moved its own half of the KV: the same bytes on each rank, on both sides
    moved = {name: {rank: v - before[name].get(rank, 0) for rank, v in _rank_bytes(procs[name].url).items()}
             for name in ("prefill", "decode")}
    assert moved["prefill"]["0"] > 0 and moved["prefill"]["0"] == moved["prefill"]["1"]
    assert moved["decode"] == moved["prefill"]


def test_tp2_to_tp2_streamed_gives_the_colocated_text(cluster) -> None:
    _, procs = cluster
    body = {"model": "pdserve-tiny", "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "stream": True}
    text, events = read_stream(procs["proxy"].url, "/v1/completions", body, "tp-stream")
    want = _complete(procs["both"].url, PROMPTS[1], max_tokens=16)["text"]
    assert text == want and len(events) > 1


def _rank1_pair(dealer, consumer: str):
    """A pair with prefill rank 1 (one of the model's 2 KV heads) whose handshake names ``consumer``,
    joined (a pair left waiting for its consumer would hold up the rank's stop)."""
    model = ModelConfig.from_dir(ensure_embedded_model(Path("~/.cache/pdserve/models").expanduser()))
    layout = dataclasses.replace(model.kv_layout(16, "float32"), num_kv_heads=model.num_kv_heads // 2)
    pair_id = uuid.uuid4().hex
    dealer.send(encode(Handshake(id=1, pair_id=pair_id, layout=layout.to_dict(), backend="tcp",
                                 endpoint=Endpoint.local("cpu").to_dict(), consumer=consumer)))
    assert dealer.poll(10_000), "no handshake reply"
    reply = decode(dealer.recv())
    assert isinstance(reply, HandshakeOk), reply
    return open_pair("tcp", 1, TIMEOUT_S, pair_id, connect_timeout_s=10, host=reply.store_host,
                     port=reply.store_port)


def test_prefill_rank1_gives_pair_slots_to_registered_decode_ranks_first(cluster) -> None:
    """Keyless, rank 0 forwards the registry's member list to rank 1 (issue 33): there a pair naming
    no registered decode rank is a stranger's, dropped once its 5 s of probation are up, while one
    naming the decode node's rank 1 is a member's and keeps its slot."""
    _, procs = cluster
    prefill, member = procs["prefill"], f"127.0.0.1:{procs['decode'].kv_port + 1}"

    def told() -> bool:  # a step on the prefill node forwards the list: a request makes one
        _complete(procs["proxy"].url, PROMPTS[0])
        return "rank 1: 2 registered decode KV address(es) are members" in prefill.log.read_text()

    def dropped(consumer: str) -> bool:
        return f"of '{consumer}': it names no registered decode node" in prefill.log.read_text()

    assert wait_for(told, 30, step=0.5), prefill.log_tail()
    with raw_dealer(f"127.0.0.1:{prefill.kv_port + 1}") as dealer:
        pairs = [_rank1_pair(dealer, "127.0.0.1:9"), _rank1_pair(dealer, member)]
        try:  # a later handshake finds the probation over
            assert wait_for(lambda: pairs.append(_rank1_pair(dealer, "")) or dropped("127.0.0.1:9"), 15, step=0.5), \
                prefill.log_tail()
            assert not dropped(member)
        finally:
            for pair in pairs:
                pair.close()


def test_a_prefill_rank_killed_mid_transfer_fails_the_request_once_and_frees_decode_blocks(cluster) -> None:
    tmp, procs = cluster
    # a decode node that knows no registry (it pulls from any prefill node, as behind vLLM's proxy)
    decode = start("decode", tmp, *TP, *ARGS, "--no-enable-prefix-caching", name="decode-survivor", wait=False)
    victim = start("prefill", tmp, *TP, *ARGS, name="prefill-victim", wait=False)
    rank1 = None
    try:
        for node in (decode, victim):  # loaded together
            node.wait_ready()
        (rank1,) = children(victim.popen.pid)
        os.kill(rank1, signal.SIGSTOP)  # rank 1 answers nothing: decode's rank 1 waits on it
        rid = make_request_id(victim.kv_addr, decode.kv_addr)
        body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            leg = pool.submit(post, decode.url, "/v1/completions", body, rid)
            wait_until(lambda: metric(decode.url, "pdserve:kv_cache_usage_perc") > 0, "decode allocated", 20)
            os.kill(rank1, signal.SIGKILL)  # mid-transfer: decode's ranks have asked, nothing landed
            r = leg.result()
        assert r.status_code >= 500
        message = r.json()["error"]["message"]
        assert message.startswith("tensor-parallel rank "), message  # one error: the rank that failed first
        wait_until(lambda: victim.popen.poll() is not None, "the victim's rank 0 left", 10)
        assert victim.popen.returncode == 3
        wait_idle(decode.url, timeout=TIMEOUT_S + LEASE_S + 5)  # both decode ranks' blocks: one block manager
        (d_rank1,) = children(decode.popen.pid)
        assert not gone(d_rank1)  # the decode node's ranks survive and serve on
        text, n = disaggregated(procs["prefill"], decode, "/v1/completions", body)
        assert n == 8 and text == _complete(procs["both"].url, PROMPTS[1], max_tokens=8)["text"]
        assert len([line for line in decode.log.read_text().splitlines() if "KV transfer failed" in line]) == 1
    finally:
        if rank1 is not None and not gone(rank1):
            os.kill(rank1, signal.SIGKILL)  # a stopped process would never read its pipe's end
        victim.kill()
        decode.stop()


def test_a_decode_rank_killed_mid_transfer_frees_the_prefill_blocks(cluster) -> None:
    tmp, procs = cluster
    prefill = procs["prefill"]
    victim = start("decode", tmp, *TP, *ARGS, "--no-enable-prefix-caching", name="decode-victim")
    try:
        (rank1,) = children(victim.popen.pid)
        rid = make_request_id(prefill.kv_addr, victim.kv_addr)
        body = {"prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            pool.submit(post, victim.url, "/v1/completions", body, rid, 30)
            # both decode ranks asked both prefill ranks; the prefill leg has not come yet
            wait_until(lambda: metric(victim.url, "pdserve:kv_cache_usage_perc") > 0, "decode allocated", 20)
            os.kill(rank1, signal.SIGKILL)
            wait_until(lambda: victim.popen.poll() is not None, "the victim's rank 0 left", 10)
            p = post(prefill.url, "/v1/completions", prefill_body(body), rid)
            assert p.status_code == 200, p.text  # the prefill itself succeeds; its KV has nowhere to go
    finally:
        victim.kill()
    assert victim.popen.returncode == 3
    wait_idle(prefill.url, timeout=TIMEOUT_S + LEASE_S + 5)  # every prefill rank released its part
    got = _complete(procs["proxy"].url, PROMPTS[0])  # and the prefill node serves on
    assert got["text"] == _complete(procs["both"].url, PROMPTS[0])["text"]


@pytest.fixture(scope="module")
def p2_d1(tmp_path_factory: pytest.TempPathFactory, colocated: Proc):
    """Proxy, a prefill node of TP 2 and a decode node of TP 1 (its one rank pulls from both
    prefill ranks, each rank's head into its slice), and the colocated node to compare with."""
    tmp = tmp_path_factory.mktemp("tp-2-to-1")
    procs = {"proxy": start("proxy", tmp, wait=False)}
    try:
        registry = ("--proxy", f"127.0.0.1:{procs['proxy'].kv_port}", "--heartbeat-interval-s", "0.5")
        procs["prefill"] = start("prefill", tmp, *TP, *ARGS, *registry, wait=False)
        procs["decode"] = start("decode", tmp, *ARGS, *registry, "--no-enable-prefix-caching", wait=False)
        for proc in [*list(procs.values())[1:], procs["proxy"], colocated]:  # a node that dies starting fails here
            proc.wait_ready()
        yield {**procs, "both": colocated}
    finally:
        stop_all(procs.values())


def test_tp2_to_tp1_through_the_proxy_gives_the_colocated_answers(p2_d1) -> None:
    procs = p2_d1
    for prompt in PROMPTS:
        got, want = _complete(procs["proxy"].url, prompt), _complete(procs["both"].url, prompt)
        assert got["text"] == want["text"]
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
    body = {"model": "pdserve-tiny", "prompt": PROMPTS[1], "max_tokens": 16, "temperature": 0, "stream": True}
    text, _ = read_stream(procs["proxy"].url, "/v1/completions", body, "tp-2-to-1-stream")
    assert text == _complete(procs["both"].url, PROMPTS[1], max_tokens=16)["text"]
    for name in ("prefill", "decode"):
        wait_idle(procs[name].url)
    sent, received = _rank_bytes(procs["prefill"].url), _rank_bytes(procs["decode"].url)
    # each prefill rank sent its own head; the decode node's one rank received both
    assert sent["0"] > 0 and sent["0"] == sent["1"] and received == {"0": sent["0"] + sent["1"]}
    log = procs["decode"].log.read_text()
    for port in (procs["prefill"].kv_port, procs["prefill"].kv_port + 1):
        assert f"to 127.0.0.1:{port} uses tcp" in log  # one pair per prefill rank


@pytest.fixture(scope="module")
def kv_ranks_2(tmp_path_factory: pytest.TempPathFactory, colocated: Proc):
    """Proxy, a one-rank prefill node that presents 2 KV ranks (--kv-ranks 2: its 2 KV heads, one
    each), a decode node of TP 2 and one of TP 1 (it reads both KV ranks), and the colocated node."""
    tmp = tmp_path_factory.mktemp("kv-ranks")
    procs = {"proxy": start("proxy", tmp, wait=False)}
    try:
        registry = ("--proxy", f"127.0.0.1:{procs['proxy'].kv_port}", "--heartbeat-interval-s", "0.5")
        nodes = {"prefill": ("prefill", "--kv-ranks", "2"), "decode2": ("decode", *TP), "decode1": ("decode",)}
        for name, (role, *extra) in nodes.items():
            no_cache = ("--no-enable-prefix-caching",) if role == "decode" else ()
            procs[name] = start(role, tmp, *extra, *ARGS, *registry, *no_cache, name=name, wait=False)
        for proc in [*list(procs.values())[1:], procs["proxy"], colocated]:  # a node that dies starting fails here
            proc.wait_ready()
        wait_until(lambda: httpx.get(procs["proxy"].url + "/ready", timeout=5).json()["nodes"] == {"P": 1, "D": 2},
                   "both decode nodes registered")
        yield {**procs, "both": colocated}
    finally:
        stop_all(procs.values())


@pytest.mark.parametrize("decode", ["decode2", "decode1"])
def test_a_prefill_node_with_two_kv_ranks_serves_decode_tp2_and_tp1(kv_ranks_2, decode) -> None:
    """Decode TP 2: rank r pulls KV rank r (one head each, a slice of the prefill rank's two).
    Decode TP 1: its rank pulls both KV ranks, each into its slice. Both give the colocated answers,
    and every block is freed on both sides with no lease expired."""
    procs = kv_ranks_2
    prefill, node = procs["prefill"], procs[decode]
    before = _rank_bytes(node.url)
    body = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
    for stream in (False, True):
        text, n = disaggregated(prefill, node, "/v1/completions", {**body, "stream": stream})
        assert n == 12 and text == _complete(procs["both"].url, PROMPTS[1])["text"]
    wait_idle(prefill.url)
    wait_idle(node.url)
    moved = {rank: v - before.get(rank, 0) for rank, v in _rank_bytes(node.url).items()}
    if decode == "decode2":
        assert moved["0"] > 0 and moved["0"] == moved["1"]  # each rank its own head, no more
    else:
        assert moved["0"] > 0
    assert metric(prefill.url, "pdserve:kv_leases_expired_total") == 0
    log = node.log.read_text()
    assert f"to 127.0.0.1:{prefill.kv_port + 1} uses tcp" in log  # KV rank 1's endpoint


def test_through_the_proxy_a_prefill_node_with_two_kv_ranks_gives_the_colocated_answers(kv_ranks_2) -> None:
    procs = kv_ranks_2
    for prompt in PROMPTS:
        got, want = _complete(procs["proxy"].url, prompt), _complete(procs["both"].url, prompt)
        assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        assert got["logprobs"]["token_logprobs"] == pytest.approx(want["logprobs"]["token_logprobs"], abs=1e-4)
        body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0, "stream": True}
        text, _ = read_stream(procs["proxy"].url, "/v1/completions", body, "tp-kv-ranks-stream")
        assert text == want["text"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="a TP 2 prefill and decode pair needs two CUDA devices")
def test_tp2_to_tp2_on_two_gpus_gives_the_colocated_answers(tmp_path) -> None:
    """Rank r of both nodes on cuda:r: each rank pair moves its heads on its own device (cuda_ipc
    under --kv-transport auto); float32, so greedy tokens match the single-GPU colocated node."""
    gpu = ("--device", "cuda:0", "--dtype", "float32")
    with pd_cluster(tmp_path, node_args=(*TP, *ARGS, *gpu, "--no-enable-prefix-caching"),
                    colocated_args=("--block-size", "16", *gpu)) as procs:
        for prompt in PROMPTS:
            got, want = _complete(procs["proxy"].url, prompt), _complete(procs["both"].url, prompt)
            assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
        for name in ("prefill", "decode"):  # (cuda_ipc counts no bytes on the receiving side)
            assert set(_rank_bytes(procs[name].url)) == {"0", "1"}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="prefill and decode of different TP sizes need two CUDA devices")
@pytest.mark.parametrize("prefill_args, decode_args", [
    (TP, ()),  # P TP 2 -> D TP 1: the decode rank's routes from both prefill ranks (NCCL)
    (("--kv-ranks", "2"), TP),  # P TP 1 with 2 KV ranks -> D TP 2: one head slice each (NCCL)
])
def test_mixed_tp_sizes_on_two_gpus_give_the_colocated_answers(tmp_path, prefill_args, decode_args) -> None:
    gpu = ("--device", "cuda:0", "--dtype", "float32")
    procs = {"proxy": start("proxy", tmp_path, wait=False)}
    try:
        registry = ("--proxy", f"127.0.0.1:{procs['proxy'].kv_port}", "--heartbeat-interval-s", "0.5")
        procs["prefill"] = start("prefill", tmp_path, *prefill_args, *ARGS, *gpu, *registry, wait=False)
        procs["decode"] = start("decode", tmp_path, *decode_args, *ARGS, *gpu, *registry,
                                "--no-enable-prefix-caching", wait=False)
        procs["both"] = start("both", tmp_path, "--block-size", "16", *gpu, wait=False)
        for proc in list(procs.values())[1:] + [procs["proxy"]]:
            proc.wait_ready()
        for prompt in PROMPTS:
            got, want = _complete(procs["proxy"].url, prompt), _complete(procs["both"].url, prompt)
            assert got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    finally:
        stop_all(procs.values())
