"""CUDA-graph decode steps, the parts a CPU can check: buckets, padding, and that a padded step
gives exactly the tokens of the unpadded one while padding rows touch only the scratch block.

The graph itself is replaced by running the model eagerly over the same padded buffers the
graph would read (``EagerPadded.replay``); the gpu-marked tests compare the real graphs.
"""

from __future__ import annotations

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.cuda_graph import CudaGraphRunner, DecodeBuffers, choose_bucket, graph_batch_sizes
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams


def test_buckets_cover_every_batch_size_up_to_max():
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(3) == [1, 2, 3]
    sizes = graph_batch_sizes(20)
    for n in range(1, 21):
        b = choose_bucket(n, sizes)
        assert b >= n and all(s < n for s in sizes if s < b)
    assert choose_bucket(21, sizes) is None


def test_buffers_pad_rows_into_the_scratch_block():
    buf = DecodeBuffers(max_batch=8, max_blocks_per_seq=4, block_size=16, scratch_block=99,
                        device=torch.device("cpu"))
    slots = [5 * 16 + 4, 2 * 16 + 3, 6 * 16 + 8]
    buf.fill([7, 8, 9], [20, 3, 40], slots, [21, 4, 41], [[1, 5], [2], [3, 4, 6]], bucket=4)
    ids, positions, meta = buf.inputs(4)
    assert ids.tolist() == [7, 8, 9, 0] and positions.tolist() == [20, 3, 40, 0]
    assert meta.slot_mapping.tolist() == [84, 35, 104, 99 * 16]
    assert meta.seq_lens == [21, 4, 41, 1] and meta.seq_lens_tensor.tolist() == [21, 4, 41, 1]
    assert meta.query_start_loc.tolist() == [0, 1, 2, 3, 4] and meta.query_lens == [1, 1, 1, 1]
    tables = meta.block_tables.tolist()
    assert tables[0][:2] == [1, 5] and tables[1][0] == 2 and tables[2][:3] == [3, 4, 6] and tables[3][0] == 99
    buf.fill([1], [0], [16], [1], [[1]], 1)  # a smaller bucket later reuses the same buffer
    assert buf.inputs(1)[2].seq_lens == [1]
    with pytest.raises(ValueError):
        buf.fill([1, 2], [0, 0], [0, 0], [1, 1], [[1], [1]], 1)


class EagerPadded(CudaGraphRunner):
    """A 'graph' that runs the model eagerly over the padded buffers: what a replay computes."""

    def capture(self) -> int:
        return 0

    def replay(self, bucket: int) -> torch.Tensor:
        ids, positions, meta = self.buffers.inputs(bucket)
        return self.model(ids, positions, self.kv_caches, meta)


def decode_with(checkpoint, padded: bool, backend: str = "sdpa") -> tuple[list[list[int]], LLMEngine]:
    config = EngineConfig(model=str(checkpoint), device="cpu", num_kv_blocks=40, max_num_seqs=8,
                          attention_backend=backend)
    e = LLMEngine(config)
    if padded:
        r = e.runner
        width = -(-e.max_model_len // r.kv_layout.block_size)
        buffers = DecodeBuffers(8, width, r.kv_layout.block_size, r.scratch_block, r.device)
        r.graphs = EagerPadded(r.model, r.kv_caches, buffers, graph_batch_sizes(8))
    prompts = [[5 + i] * (3 + 7 * i) for i in range(5)]
    greedy = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True) for i in range(4)]
    seeded = SamplingParams(temperature=1.0, seed=11, max_tokens=9, ignore_eos=True)
    return e.generate(prompts, greedy + [seeded]), e  # 5 rows pad to 8, then 4, 2, 1 as they finish


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
def test_padded_decode_steps_give_the_unpadded_tokens(checkpoint_dir, backend):
    """Against the plain SDPA engine; with triton the kernel (interpreted here) reads the graph's buffers."""
    if backend == "triton":
        pytest.importorskip("triton")
    path = checkpoint_dir("qwen3")
    want, plain = decode_with(path, padded=False)
    got, padded = decode_with(path, padded=True, backend=backend)
    assert got == want
    assert [len(t) for t in got] == [4, 7, 10, 13, 9]
    scratch = padded.runner.scratch_block
    for a, b in zip(plain.kv_caches, padded.kv_caches):
        torch.testing.assert_close(b[:, :scratch], a[:, :scratch], rtol=0, atol=1e-5)  # real blocks alike
        assert a[:, scratch].abs().sum() == 0 and b[:, scratch].abs().sum() > 0  # padding wrote only there


def test_enforce_eager_from_flag_env_and_default():
    from common.config import NodeConfig, load_config

    def engine_config(argv, env):
        return load_config(NodeConfig, argv, "pdserve serve", env=env)  # the node's config is the engine's

    assert engine_config([], {}).enforce_eager is False
    assert engine_config(["--enforce-eager"], {}).enforce_eager is True
    assert engine_config([], {"PDSERVE_ENFORCE_EAGER": "true"}).enforce_eager is True


def test_no_graphs_and_no_reserve_off_cuda(checkpoint_dir):
    from common.engine.cuda_graph import graph_memory

    e = LLMEngine(EngineConfig(model=str(checkpoint_dir("llama")), device="cpu", num_kv_blocks=8))
    assert e.runner.graphs is None and e.runner.attn_backend.name == "sdpa"
    assert e.kv_caches[0].shape[1] == 8 + 1  # the scratch block past the block manager's blocks
    assert graph_memory(e.runner.model, e.kv_layout, e.config, 512) == 0
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(attention_backend="flash")
