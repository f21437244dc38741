"""A request split between a producer and a consumer engine samples like one engine.

The producer samples the first token (seeded, with logprobs); the test copies the KV into
the consumer's blocks and reports the first token with its logprobs, as a transfer does.
The consumer hands that token out on its own, before it computes anything, then goes on
with the same seeded stream: tokens and logprobs equal a colocated run.
"""

from __future__ import annotations

import pytest

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from helpers.fake_kv_worker import RecordingWorker, consumer, producer

PROMPT = [7, 100, 31, 4, 250, 18, 66, 9, 12, 200, 5, 41, 77, 3, 150, 90, 11, 23, 34]


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_k=60, seed=2024, max_tokens=max_tokens, logprobs=2,
                          ignore_eos=True)


def make(path, connector=None) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16), connector)


def run(e: LLMEngine, rid: str, max_tokens: int, **kw) -> tuple[list[int], list[dict]]:
    e.add_request(rid, PROMPT, params(max_tokens), **kw)
    tokens, logprobs = [], []
    while e.has_unfinished_requests():
        for out in e.step():
            tokens += out.new_token_ids
            logprobs += out.new_logprobs or []
    return tokens, logprobs


def test_first_token_goes_out_alone_before_compute_and_the_stream_continues(checkpoint_dir):
    path = checkpoint_dir("qwen3")
    expected_tokens, expected_logprobs = run(make(path), "colocated", 10)

    pw = RecordingWorker()
    p = make(path, producer(pw))
    [first], [first_logprobs] = run(p, "x", 1, kv_transfer_params={"decode_addr": "127.0.0.1:1"})
    held = p.scheduler.blocks_lent["x"]
    [handover] = [h for m in pw.metas for h in m.handovers]
    assert handover.first_token == first and dict(handover.first_logprobs) == first_logprobs

    landing = RecordingWorker()
    d = make(path, consumer(landing))
    d.add_request("x", PROMPT, params(10), kv_transfer_params={"prefill_addr": "127.0.0.1:2"})
    assert d.step() == [] and landing.loads["x"][0] == 0
    for src, dst in zip(p.kv_caches, d.kv_caches):
        dst[:, landing.loads["x"][1]] = src[:, held.block_table]

    events: list = []
    run_model = d.runner.run
    d.runner.run = lambda *a, **k: (events.append(("compute", None)), run_model(*a, **k))[1]
    landing.land("x", first, first_logprobs)
    events.append(("early", [o.new_token_ids for o in d.poll_transfers()]))  # as AsyncLLMEngine does
    outs = d.step()
    assert events[:2] == [("early", [[first]]), ("compute", None)]
    assert [o.new_token_ids for o in outs] == [[expected_tokens[1]]]  # the next token, on its own

    tokens, logprobs = [first, expected_tokens[1]], [first_logprobs, outs[0].new_logprobs[0]]
    while d.has_unfinished_requests():
        for out in d.step():
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
    assert tokens == expected_tokens and len(set(tokens)) > 3
    assert len(logprobs) == len(expected_logprobs)
    for got, want in zip(logprobs, expected_logprobs):
        assert list(got) == list(want)
        assert list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)
