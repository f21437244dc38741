"""A decode node pulls KV only from prefill nodes it knows (issue 22, finding 2): without a
key, a tagged id sent straight to decode that names a stranger's "producer" is refused
before anything is pulled, so the stranger's bytes never reach decode's prefix cache, and
honest requests afterwards answer exactly as a colocated node does."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from common.model.config import ModelConfig
from common.model.embedded import ensure_embedded_model
from common.request_id import make_request_id
from helpers.cluster import Proc

PROMPT = "The quick brown fox jumps over the lazy dog while the cat watches from the warm windowsill"


@pytest.fixture
def cluster(shared_cluster: dict[str, Proc]) -> dict[str, Proc]:
    return shared_cluster  # the decode node knows the prefill node from the proxy's registry


@pytest.fixture(scope="module")
def stranger():
    model = ModelConfig.from_dir(ensure_embedded_model(Path("~/.cache/pdserve/models").expanduser()))
    with KVEndpoint("127.0.0.1:0", model.kv_layout(16, "float32"), TransferConfig()) as engine:
        yield engine


def _text(url: str, request_id: str | None = None) -> httpx.Response:
    body = {"model": "pdserve-tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    headers = {"X-Request-Id": request_id} if request_id else {}
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


def test_stranger_producer_is_refused_and_honest_answers_match_colocated(cluster, stranger):
    decode = cluster["decode"]
    rid = make_request_id(stranger.address, decode.kv_addr, "stranger")
    refused = _text(decode.url, rid)
    assert refused.status_code >= 400 or '"error"' in refused.text, refused.text
    assert "not a known prefill node" in refused.text, refused.text
    assert stranger.producer.request_state(rid) == "unknown"  # never asked: nothing was pulled
    expected = _text(cluster["both"].url)
    assert expected.status_code == 200, expected.text
    for _ in range(2):  # the second one may find the prompt in decode's prefix cache
        got = _text(cluster["proxy"].url)
        assert got.status_code == 200, got.text
        assert got.json()["choices"][0]["text"] == expected.json()["choices"][0]["text"]
