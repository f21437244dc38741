"""``--batch-invariant`` across real processes: one answer, whatever the load and the path.

A proxy with a prefill and a decode daemon (every request split, P->D) and a colocated node,
all started with ``--batch-invariant``. One prompt sent 200 times at 16 concurrent among random
other prompts gives one distinct answer and one logprob vector on the colocated node and
through P->D, and the two are the same; the same prompt with the prefix cache cold and warm
gives that answer too. (Without the mode a near-tie under load is what breaks this; the
engine test ``tests/common/engine/test_batch_invariant_engine.py`` shows the default path's
logits moving with the batch.)
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from helpers.cluster import pd_cluster

NODE_ARGS = ("--batch-invariant", "--block-size", "16", "--max-num-batched-tokens", "64")
PROMPT = [(11 * i + 5) % 2000 + 4 for i in range(60)]  # chunked over steps: 60 tokens, 64 a step, among others
REPEATS, CONCURRENCY, MAX_TOKENS = 200, 16, 16


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    with pd_cluster(tmp_path_factory.mktemp("batch-invariant"), ("--disagg-policy", "always"), NODE_ARGS,
                    NODE_ARGS) as procs:
        yield procs


def _complete(url: str, prompt: list[int], max_tokens: int = MAX_TOKENS, temperature: float = 0.0) -> tuple:
    body = {"model": "pdserve-tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature,
            "ignore_eos": True, "logprobs": 1}
    reply = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    choice = data["choices"][0]
    lp = choice["logprobs"]
    return (choice["text"], tuple(lp["token_logprobs"]), tuple(map(str, lp["top_logprobs"]))), \
        data["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)


def _under_load(url: str) -> set[tuple]:
    """The target's answers, sent REPEATS times at CONCURRENCY among random others (1 in 3 requests)."""
    rng = random.Random(0)
    jobs = []
    for i in range(REPEATS * 3 // 2):
        if i % 3 == 2:
            other = [rng.randrange(4, 2000) for _ in range(rng.randrange(1, 120))]
            jobs.append((other, rng.randrange(1, 24), rng.choice([0.0, 1.0])))
        else:
            jobs.append((PROMPT, MAX_TOKENS, 0.0))
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        replies = list(pool.map(lambda job: (job[0] is PROMPT, _complete(url, *job)[0]), jobs))
    answers = [answer for is_target, answer in replies if is_target]
    assert len(answers) == REPEATS
    return set(answers)


def test_one_prompt_under_load_gives_one_answer_colocated_and_through_prefill_decode(cluster: dict) -> None:
    colocated = _under_load(cluster["both"].url)
    assert len(colocated) == 1
    split = _under_load(cluster["proxy"].url)
    assert split == colocated
    text, logprobs, _ = next(iter(colocated))
    assert len(logprobs) == MAX_TOKENS


def test_prefix_cache_cold_and_warm_give_the_same_answer(cluster: dict) -> None:
    prompt = [(13 * i + 1) % 2000 + 4 for i in range(90)]
    for url in (cluster["both"].url, cluster["proxy"].url):
        cold, cold_cached = _complete(url, prompt)
        warm, warm_cached = _complete(url, prompt)
        assert (cold_cached, warm_cached) == (0, 80)  # 5 whole blocks found the second time
        assert warm == cold
    assert _complete(cluster["both"].url, prompt)[0] == _complete(cluster["proxy"].url, prompt)[0]
