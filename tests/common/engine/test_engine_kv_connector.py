"""The connector hooks, exercised by a fake producer (colocated engine) and a fake consumer.

The producer engine runs the prefill and holds the blocks; the test copies that KV into
the blocks the consumer engine allocated and reports the first token, as a transfer would.
The consumer's decode must then equal a colocated greedy run token for token.
"""

from __future__ import annotations

from common.engine.config import EngineConfig
from common.engine.kv_connector import FinishedTransfers, KVConnectorBase
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams

PROMPT = [7, 100, 31, 4, 250, 18, 66, 9, 12, 200, 5, 41, 77, 3, 150, 90, 11, 23, 34]  # 19 tokens: 2 blocks
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


class FakeProducer(KVConnectorBase):
    def __init__(self):
        self.saved: dict[int, int] = {}  # layer -> calls
        self.finished: list[str] = []
        self.acked: set[str] = set()

    def save_kv_layer(self, layer_idx, kv_layer, seqs, attn_metadata):
        assert attn_metadata.slot_mapping.numel() == sum(attn_metadata.query_lens)
        self.saved[layer_idx] = self.saved.get(layer_idx, 0) + 1

    def request_finished(self, seq):
        self.finished.append(seq.request_id)
        return True  # keep the blocks until the peer has read them

    def get_finished(self):
        done, self.acked = self.acked, set()
        return FinishedTransfers(done_sending=done)


class FakeConsumer(KVConnectorBase):
    def __init__(self):
        self.allocated: dict[str, list[int]] = {}
        self.result = FinishedTransfers()

    def num_external_tokens(self, seq):
        return len(seq.prompt_token_ids) if seq.kv_transfer_params.get("remote") else 0

    def on_blocks_allocated(self, seq, block_ids):
        self.allocated[seq.request_id] = block_ids

    def get_finished(self):
        result, self.result = self.result, FinishedTransfers()
        return result


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

    producer = FakeProducer()
    p = make(path, producer, max_num_batched_tokens=8)  # chunked prefill: hooks fire per chunk
    p.add_request("x", PROMPT, SamplingParams(temperature=0, max_tokens=1))
    [first] = [t for o in drain(p) for t in o.new_token_ids]
    assert first == expected[0] and producer.finished == ["x"]
    assert set(producer.saved) == {0, 1} and producer.saved[0] == 3  # 19 tokens in chunks of 8
    held = p.scheduler.held["x"]
    assert p.block_manager.num_free_blocks == 16 - 2

    consumer = FakeConsumer()
    d = make(path, consumer)
    d.add_request("x", PROMPT, GREEDY, kv_transfer_params={"remote": True})
    d.add_request("local", [1, 2, 3], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    outs = [o for _ in range(6) for o in d.step()]  # parked "x" does not hold up "local"
    assert [o.request_id for o in outs if o.finished] == ["local"]
    assert d.stats().num_waiting == 1 and "x" in d.scheduler.parked
    for src, dst in zip(p.kv_caches, d.kv_caches):
        dst[:, consumer.allocated["x"]] = src[:, held.block_table]
    consumer.result = FinishedTransfers(done_recving={"x": first})
    outs = drain(d)
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == expected and outs[0].new_token_ids[0] == first
    assert d.block_manager.num_free_blocks == 16

    producer.acked = {"x"}
    p.step()  # idle step still polls get_finished
    assert p.block_manager.num_free_blocks == 16 and not p.has_pending_transfers()


def test_failed_transfer_finishes_with_error(checkpoint_dir):
    consumer = FakeConsumer()
    d = make(checkpoint_dir("qwen3"), consumer)
    d.add_request("x", PROMPT, GREEDY, kv_transfer_params={"remote": True})
    d.step()
    assert d.block_manager.num_free_blocks == 14
    consumer.result = FinishedTransfers(failed_recving={"x": "peer went away"})
    [out] = d.step()
    assert out.finished and out.finish_reason == "error" and out.error == "peer went away"
    assert d.block_manager.num_free_blocks == 16 and not d.has_unfinished_requests()


def test_abort_while_parked_frees_blocks(checkpoint_dir):
    consumer = FakeConsumer()
    d = make(checkpoint_dir("qwen3"), consumer)
    d.add_request("x", PROMPT, GREEDY, kv_transfer_params={"remote": True})
    d.step()
    d.abort_request("x")
    [out] = d.step()
    assert out.finish_reason == "abort" and d.block_manager.num_free_blocks == 16


def test_first_token_alone_can_finish(checkpoint_dir):
    consumer = FakeConsumer()
    d = make(checkpoint_dir("qwen3"), consumer)
    d.add_request("x", PROMPT, SamplingParams(temperature=0, max_tokens=1), kv_transfer_params={"remote": True})
    d.step()
    consumer.result = FinishedTransfers(done_recving={"x": 42})
    [out] = d.step()
    assert out.new_token_ids == [42] and out.finish_reason == "length"
    assert d.block_manager.num_free_blocks == 16
