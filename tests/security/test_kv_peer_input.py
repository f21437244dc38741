"""A producer's DONE is client input (issue 22, finding 3): a first token outside the
vocabulary or a bad logprob fails that request alone, and the decode engine goes on.

The producer is a real KV endpoint in this process that a test drives by hand, so it
can say what an honest prefill node never would; the decode daemon is a real process.
"""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import pytest
import torch

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from common.model.config import ModelConfig
from common.model.embedded import ensure_embedded_model
from common.request_id import make_request_id
from helpers.cluster import Proc, start
from helpers.waiting import wait_for

_COUNT = iter(range(1, 10**6))  # each request its own id and prompt: nothing comes from the prefix cache


@pytest.fixture(scope="module")
def decode(tmp_path_factory: pytest.TempPathFactory):
    proc = start("decode", tmp_path_factory.mktemp("peer-input"), "--kv-timeout-s", "5")
    try:
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def producer():
    model = ModelConfig.from_dir(ensure_embedded_model(Path("~/.cache/pdserve/models").expanduser()))
    layout = model.kv_layout(16, "float32")
    engine = KVEndpoint("127.0.0.1:0", layout, TransferConfig(timeout_s=5.0, lease_s=10.0))
    try:
        yield engine
    finally:
        engine.close()


def _complete(decode: Proc, producer: KVEndpoint, first_token: int, logprobs: dict[int, float] | None) -> httpx.Response:
    """Send one tagged request straight to decode; answer its PULL with this DONE."""
    n = next(_COUNT)
    rid = make_request_id(producer.address, decode.kv_addr, f"peer-input-{n}")
    prompt = [5 + (n * 20 + i) % 2000 for i in range(20)]  # 20 tokens: 2 blocks of 16
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": 3, "temperature": 0}
    if logprobs is not None:
        body["logprobs"] = 1
    box: dict = {}

    def post() -> None:
        box["r"] = httpx.post(decode.url + "/v1/completions", json=body, headers={"X-Request-Id": rid},
                              timeout=30)

    thread = threading.Thread(target=post)
    thread.start()
    assert wait_for(lambda: producer.producer.request_state(rid) == "pulled", 20), decode.log_tail()
    layout = producer.layout
    kv = [torch.zeros(layout.layer_shape(4), dtype=layout.torch_dtype) for _ in range(layout.num_layers)]
    producer.producer.finish(rid, first_token, kv, [0, 1], len(prompt), logprobs)
    thread.join(30)
    producer.producer.poll_freeable()
    return box["r"]


@pytest.mark.parametrize("first_token, logprobs", [(-5, None), (10**9, None), (7, {7: float("nan")}),
                                                   (7, {-1: -0.5}), (7, {7: 3.0})],
                         ids=["token-5", "token1e9", "nan-logprob", "bad-logprob-token", "positive-logprob"])
def test_bad_done_fails_its_request_alone(decode: Proc, producer: KVEndpoint, first_token, logprobs):
    bad = _complete(decode, producer, first_token, logprobs)
    assert bad.status_code >= 400 or bad.json()["choices"][0]["finish_reason"] == "error", bad.text
    assert "bad DONE" in bad.text, bad.text
    honest = _complete(decode, producer, 7, {7: -0.25} if logprobs else None)
    assert honest.status_code == 200, honest.text
    assert httpx.get(decode.url + "/ready", timeout=5).status_code == 200
