"""``n`` > 1 across real processes: proxy -> prefill -> decode beside a colocated node.

The prompt's KV moves once whatever n is (the decode node forks the choices from the
transferred blocks with the prefill node's n first tokens), the answers equal the colocated
node's, and the openai SDK gets its n choices, streamed and not. Parity in both dispatch
orders, streamed chunk by chunk, is in tests/test_fidelity_e2e.py.
"""

from __future__ import annotations

import random

import httpx
import openai
import pytest

from helpers.cluster import metric, pd_cluster

BLOCK = 16
# the embedded model: 4 layers x (K and V) x 2 KV heads x head_dim 64 x fp32, per token
BYTES_PER_BLOCK = 4 * 2 * 2 * 64 * 4 * BLOCK
NODE_ARGS = ("--block-size", str(BLOCK), "--max-num-batched-tokens", "64")
MODEL = "pdserve-tiny"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with pd_cluster(tmp_path_factory.mktemp("n-choices"), ("--disagg-policy", "always"), NODE_ARGS,
                    NODE_ARGS) as procs:
        yield procs


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 256) for _ in range(n)]


def _choices(url: str, body: dict) -> list[tuple[int, str, str]]:
    reply = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return [(c["index"], c["text"], c["finish_reason"]) for c in reply.json()["choices"]]


def test_n4_moves_the_prompt_kv_once(cluster: dict) -> None:
    moved = {}
    for n, seed in ((1, 1), (4, 2)):  # fresh prompts of one length: nothing cached on either node
        body = {"model": MODEL, "prompt": _prompt(130, seed), "n": n, "max_tokens": 6, "temperature": 1.0,
                "seed": 5, "ignore_eos": True}
        before = metric(cluster["decode"].url, "pdserve:kv_transfer_bytes_total")
        got = _choices(cluster["proxy"].url, body)
        moved[n] = metric(cluster["decode"].url, "pdserve:kv_transfer_bytes_total") - before
        assert got == _choices(cluster["both"].url, body) and len(got) == n
    assert moved[4] == moved[1] == 9 * BYTES_PER_BLOCK  # 130 tokens: 9 blocks, once


def test_openai_sdk_gets_n_choices(cluster: dict) -> None:
    sdk = {role: openai.OpenAI(base_url=cluster[role].url + "/v1", api_key="none", max_retries=0)
           for role in ("proxy", "both")}
    kwargs = {"model": MODEL, "prompt": "The quick brown fox", "n": 3, "max_tokens": 5, "temperature": 0.9,
              "seed": 4, "extra_body": {"ignore_eos": True}}
    replies = {role: client.completions.create(**kwargs) for role, client in sdk.items()}
    assert [c.index for c in replies["proxy"].choices] == [0, 1, 2]
    assert [c.text for c in replies["proxy"].choices] == [c.text for c in replies["both"].choices]
    assert replies["proxy"].usage.completion_tokens == replies["both"].usage.completion_tokens == 15
    messages = [{"role": "user", "content": "Say something"}]
    texts = {}
    for role, client in sdk.items():
        texts[role] = {}
        stream = client.chat.completions.create(model=MODEL, messages=messages, n=2, max_tokens=6,
                                                temperature=1.0, seed=8, stream=True)
        for chunk in stream:
            for choice in chunk.choices:
                texts[role][choice.index] = texts[role].get(choice.index, "") + (choice.delta.content or "")
    assert sorted(texts["proxy"]) == [0, 1] and texts["proxy"] == texts["both"]
    with pytest.raises(openai.BadRequestError) as err:
        sdk["proxy"].completions.create(**{**kwargs, "n": 17})
    assert err.value.body["param"] == "n" and err.value.body["code"] == "invalid_value"
