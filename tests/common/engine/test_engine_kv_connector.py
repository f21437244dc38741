"""The connector split in one process: real scheduler sides, a recording worker for the wire.

The real scheduler sides decide; a recording worker stands in for the KV endpoint. The
producer engine runs the prefill and holds the blocks; the test copies that KV into the
blocks the consumer engine asked to load and reports the first token, as a transfer would.
The consumer's decode must then equal a colocated greedy run token for token.
"""

from __future__ import annotations

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from helpers.fake_kv_worker import RecordingWorker, consumer, producer

PROMPT = [7, 100, 31, 4, 250, 18, 66, 9, 12, 200, 5, 41, 77, 3, 150, 90, 11, 23, 34]  # 19 tokens: 2 blocks
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

TO_D = {"decode_addr": "127.0.0.1:1"}  # a prefill leg's tag
FROM_P = {"prefill_addr": "127.0.0.1:2"}  # a decode leg's tag


def make(path, connector, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16, **kw), connector)


def drain(e: LLMEngine, steps: int = 1000) -> list:
    outs = []
    for _ in range(steps):
        if not e.has_unfinished_requests():
            break
        outs += e.step()
    return outs


def test_producer_to_consumer_matches_colocated(checkpoint_dir):
    path = checkpoint_dir("qwen3")
    expected = make(path, None).generate([PROMPT], GREEDY)[0]

    pw = RecordingWorker()
    p = make(path, producer(pw), max_num_batched_tokens=8)  # chunked prefill: 3 passes
    p.add_request("x", PROMPT, SamplingParams(temperature=0, max_tokens=1), kv_transfer_params=TO_D)
    [first] = [t for o in drain(p) for t in o.new_token_ids]
    # drain stops after the step that sampled: the hand-over reached the worker within that step
    assert first == expected[0] and pw.handed_over == ["x"]
    assert pw.saved_layers == {"x": [0, 1]}  # only the pass that completes the prompt saves
    held = p.scheduler.blocks_lent["x"]
    assert p.block_manager.num_free_blocks == 16 - 2

    dw = RecordingWorker()
    d = make(path, consumer(dw))
    d.add_request("x", PROMPT, GREEDY, kv_transfer_params=FROM_P)
    d.add_request("local", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outs = [o for _ in range(6) for o in d.step()]  # parked "x" does not hold up "local"
    assert [o.request_id for o in outs if o.finished] == ["local"]
    assert d.stats().num_waiting == 1 and "x" in d.scheduler.parked
    for src, dst in zip(p.kv_caches, d.kv_caches):
        dst[:, dw.loads["x"][1]] = src[:, held.block_table]
    dw.land("x", first)
    outs = drain(d)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == expected and outs[0].new_token_ids[0] == first
    assert d.block_manager.num_free_blocks == 16

    pw.ack("x")
    p.step()  # idle step still polls get_finished
    assert p.block_manager.num_free_blocks == 16 and not p.has_pending_transfers()


def test_failed_transfer_finishes_with_error(checkpoint_dir):
    dw = RecordingWorker()
    d = make(checkpoint_dir("qwen3"), consumer(dw))
    d.add_request("x", PROMPT, GREEDY, kv_transfer_params=FROM_P)
    d.step()
    assert d.block_manager.num_free_blocks == 14
    dw.fail("x", "peer went away")
    [out] = d.step()
    assert out.finished and out.finish_reason == "error" and out.error == "peer went away"
    assert d.block_manager.num_free_blocks == 16 and not d.has_unfinished_requests()


def test_abort_while_loading_holds_blocks_until_the_receive_stops(checkpoint_dir):
    dw = RecordingWorker()
    d = make(checkpoint_dir("qwen3"), consumer(dw))
    d.add_request("x", PROMPT, GREEDY, kv_transfer_params=FROM_P)
    d.step()
    d.abort_request("x")  # the load went out last step: a receive may be writing into the blocks
    [out] = d.step()  # the abort reaches the worker in this step's metadata
    assert out.finish_reason == "abort" and dw.metas[-1].aborts == ("x",)
    assert d.block_manager.num_free_blocks == 14 and d.has_pending_transfers()
    d.step()  # the worker reports the receive stopped
    assert d.block_manager.num_free_blocks == 16 and not d.has_pending_transfers()


def test_first_token_alone_can_finish(checkpoint_dir):
    dw = RecordingWorker()
    d = make(checkpoint_dir("qwen3"), consumer(dw))
    d.add_request("x", PROMPT, SamplingParams(temperature=0, max_tokens=1), kv_transfer_params=FROM_P)
    d.step()
    dw.land("x", 42)
    [out] = d.step()
    assert out.new_token_ids == [42] and out.finish_reason == "length"
    assert d.block_manager.num_free_blocks == 16
