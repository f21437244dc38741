"""Prefill -> decode through two real daemon processes is token-identical to a colocated node.

Greedy output of a prefill daemon + decode daemon pair (KV pushed over the pair's tcp plane)
must equal a role-``both`` node's output — on the embedded model and on a tiny random
Qwen3 checkpoint —, in both dispatch orders, streaming or not,
for short prompts, prompts spanning many blocks, chunked prefills, and many requests
at once. Afterwards both daemons hold no KV block.
"""

from __future__ import annotations

import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from disagg_client import disaggregated, post

from common.model.embedded import ensure_embedded_model
from helpers.cluster import start, stop_all, wait_idle
from helpers.hf_checkpoints import make_checkpoint

# a small token budget per step forces chunked prefill on prompts past 48 tokens
ENGINE_ARGS = ("--max-num-batched-tokens", "48", "--block-size", "16", "--log-level", "info")


def _random_qwen3(tmp: Path) -> Path:
    """A tiny random Qwen3 checkpoint (q/k norm) with the embedded model's tokenizer: its
    256-token vocabulary is a prefix of the tokenizer's, so token-id prompts below 256 work."""
    path = make_checkpoint(tmp, "qwen3")
    embedded = ensure_embedded_model()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded / name, path / name)
    return path


@pytest.fixture(scope="module", params=["embedded", "random-qwen3"])
def nodes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("disagg")
    model_args = () if request.param == "embedded" else ("--model", str(_random_qwen3(tmp)))
    started = []
    try:
        for role in ("both", "prefill", "decode"):  # started together: model loads overlap
            started.append(start(role, tmp, *ENGINE_ARGS, *model_args, wait=False))
        for proc in started:
            proc.wait_ready()
        yield {"model": request.param, **dict(zip(("both", "prefill", "decode"), started))}
    finally:
        stop_all(started)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 256) for _ in range(n)]  # within both models' vocabularies


def _colocated(both, body: dict, path: str = "/v1/completions") -> tuple[str, int]:
    r = post(both.url, path, {**body, "stream": False})
    assert r.status_code == 200, r.text
    data = r.json()
    choice = data["choices"][0]
    return choice.get("text") or choice["message"]["content"], data["usage"]["completion_tokens"]


def _body(prompt: list[int], max_tokens: int = 12, **extra) -> dict:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}


@pytest.mark.parametrize("order", ["concurrent", "prefill_first"])
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("length", [5, 40, 300], ids=["short", "blocks", "chunked"])
def test_parity_with_colocated(nodes: dict, order: str, stream: bool, length: int) -> None:
    body = _body(_prompt(length, seed=length))
    expected = _colocated(nodes["both"], body)
    got = disaggregated(nodes["prefill"], nodes["decode"], "/v1/completions", {**body, "stream": stream}, order)
    assert got == expected
    assert expected[1] == 12


# the embedded model only: chat text tokenizes past the random checkpoint's 256-token vocabulary
# (the completions cases above cover that checkpoint's disaggregation)
@pytest.mark.parametrize("nodes", ["embedded"], indirect=True)
def test_chat_parity(nodes: dict) -> None:
    body = {"messages": [{"role": "user", "content": "How do I read a file in Python?"}],
            "max_tokens": 10, "temperature": 0, "ignore_eos": True}
    expected = _colocated(nodes["both"], body, "/v1/chat/completions")
    assert disaggregated(nodes["prefill"], nodes["decode"], "/v1/chat/completions", body) == expected
    assert disaggregated(nodes["prefill"], nodes["decode"], "/v1/chat/completions", {**body, "stream": True},
                         "prefill_first") == expected


def test_twenty_concurrent_requests_of_mixed_lengths(nodes: dict) -> None:
    rng = random.Random(7)
    bodies = [_body(_prompt(rng.randrange(3, 200), seed=100 + i), max_tokens=rng.randrange(2, 16))
              for i in range(20)]
    expected = [_colocated(nodes["both"], b) for b in bodies]
    orders = ["concurrent", "prefill_first"]
    with ThreadPoolExecutor(20) as pool:
        futures = [pool.submit(disaggregated, nodes["prefill"], nodes["decode"], "/v1/completions",
                               {**b, "stream": i % 3 == 0}, orders[i % 2]) for i, b in enumerate(bodies)]
        got = [f.result() for f in futures]
    assert got == expected


def test_daemons_hold_no_blocks_when_idle(nodes: dict) -> None:
    disaggregated(nodes["prefill"], nodes["decode"], "/v1/completions", _body(_prompt(64, seed=1)))
    wait_idle(nodes["prefill"].url)
    wait_idle(nodes["decode"].url)


def test_untagged_request_to_a_daemon_is_refused(nodes: dict) -> None:
    for role in ("prefill", "decode"):
        r = post(nodes[role].url, "/v1/completions", _body([5, 6, 7]))
        assert r.status_code == 400
        assert "___prefill_addr_" in r.json()["error"]["message"]


def test_transfer_metrics_count_bytes(nodes: dict, tmp_path: Path) -> None:
    from helpers.cluster import metric

    disaggregated(nodes["prefill"], nodes["decode"], "/v1/completions", _body(_prompt(50, seed=3)))
    assert metric(nodes["decode"].url, "pdserve:kv_transfer_bytes_total") > 0
    assert metric(nodes["prefill"].url, "pdserve:kv_transfer_bytes_total") > 0
    for role in ("prefill", "decode"):  # the pair's transport, chosen at its handshake (CPU: tcp)
        text = httpx.get(nodes[role].url + "/metrics", timeout=5).text
        assert f'pdserve:kv_pairs{{role="{role}",transport="tcp"}} 1.0' in text
        assert f'pdserve:kv_pairs{{role="{role}",transport="gloo"}} 0.0' in text
    text = httpx.get(nodes["decode"].url + "/metrics", timeout=5).text
    for reason in ("not_requested", "stale", "layers", "bytes", "checksum"):  # verified KV: none refused
        assert f'pdserve:kv_transfer_rejected_total{{reason="{reason}",role="decode"}} 0.0' in text
