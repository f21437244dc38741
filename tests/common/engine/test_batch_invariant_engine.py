"""``--batch-invariant`` in the engine: one prompt's logits, bitwise, whatever else runs.

The prompt's logits at every sampled step (greedy, and a seeded sampled request's tokens) are
recorded alone, among 16 random other requests, with its prompt chunked over steps, and with
the prefix cache cold and then warm; all must be the same bits. Without the mode, the same
comparison is what fails (a batch of 16 reduces differently from one row). The same test on
CUDA (bf16, gpu-marked: ``make gpu-check``'s pytest step runs it) checks the GPU path: Triton
attention, fused ops and matmul, with decode steps replayed from CUDA graphs; and, with
``--attention-backend sdpa``, the PyTorch path there (cuBLAS's batched matmuls in row tiles).
Without a GPU, the Triton attention runs in Triton's interpreter.
"""

from __future__ import annotations

import importlib.util
import os
import random

import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.model.attn_backends.invariant import InvariantBackend
from common.model.batch_invariant import InvariantLinear, PackedLinear, packs_weights

PROMPT = [(7 * i + 3) % 2000 + 4 for i in range(70)]
MAX_TOKENS = 8


class LogitsRecorder:
    """Wraps the runner's sampler: the logits row each sampled step gave the target request."""

    def __init__(self, engine: LLMEngine) -> None:
        self.sampler = engine.runner.sampler
        self.target: list[int] | None = None  # the target sequence's own prompt list
        self.rows: list[torch.Tensor] = []
        engine.runner.sampler = self

    def __call__(self, logits, rows):
        for row, sample_row in zip(logits, rows):
            if sample_row.prompt_token_ids is self.target:
                self.rows.append(row.clone())
        return self.sampler(logits, rows)


def _engine(**overrides) -> LLMEngine:
    config = dict(model="embedded", device="cpu", batch_invariant=True, num_kv_blocks=512, block_size=16, seed=0)
    return LLMEngine(EngineConfig(**{**config, **overrides}))


def _run(engine: LLMEngine, params: SamplingParams, others: int = 0, seed: int = 0) -> tuple[torch.Tensor, list]:
    """The target's logits rows [MAX_TOKENS, vocab] and (tokens, logprobs), sent after ``others``
    random requests; ``engine.last_cached`` = its prompt tokens found in the prefix cache."""
    rng = random.Random(seed)
    recorder = engine.runner.sampler if isinstance(engine.runner.sampler, LogitsRecorder) else LogitsRecorder(engine)
    recorder.rows = []
    for i in range(others):
        prompt = [rng.randrange(4, 2000) for _ in range(rng.randrange(1, 90))]
        engine.add_request(f"other-{seed}-{i}", prompt, SamplingParams(max_tokens=rng.randrange(1, 20),
                                                                       temperature=rng.choice([0.0, 1.0])))
    for _ in range(rng.randrange(0, 3)):  # the others part-way through their prompts or decodes
        engine.step()
    rid = f"target-{seed}-{others}-{random.random()}"
    engine.add_request(rid, list(PROMPT), params)
    recorder.target = engine._requests[rid].prompt_token_ids
    tokens: list = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid:
                tokens += zip(out.new_token_ids, out.new_logprobs or [None] * len(out.new_token_ids))
                engine.last_cached = out.num_cached_tokens
    return torch.stack(recorder.rows), tokens


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, top_p=0.9, seed=11, logprobs=5, ignore_eos=True)


def test_the_mode_swaps_linears_and_attention_only_when_asked() -> None:
    plain, invariant = _engine(batch_invariant=False), _engine()
    assert not any(isinstance(m, InvariantLinear) for m in plain.runner.model.modules())
    # the default path's linears run on oneDNN where it can (CPU float32), else as nn.Linear
    packs = packs_weights(torch.device("cpu"), torch.float32)
    assert type(plain.runner.model.lm_head) is (PackedLinear if packs else torch.nn.Linear)
    assert isinstance(invariant.runner.model.lm_head, InvariantLinear)
    assert isinstance(invariant.runner.attn_backend, InvariantBackend)


@pytest.mark.skipif(not packs_weights(torch.device("cpu"), torch.float32), reason="needs torch's oneDNN")
def test_cpu_float32_runs_every_linear_on_packed_weights() -> None:
    linears = [m for m in _engine().runner.model.modules() if isinstance(m, InvariantLinear)]
    assert linears and all(m.packed is not None for m in linears)


def test_logits_bitwise_equal_alone_batched_chunked_and_cached() -> None:
    _check_invariance("cpu")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where triton is installed)")
def test_logits_bitwise_equal_with_the_triton_attention_in_the_interpreter() -> None:
    """The GPU path's attention kernel, in its invariant tiling, run by Triton's interpreter
    (the linears stay on oneDNN: CPU float32 packs first)."""
    alone_engine = _engine(attention_backend="triton", enable_prefix_caching=False)
    assert alone_engine.runner.kernels.invariant and alone_engine.runner.attn_backend.invariant
    alone, alone_tokens = _run(alone_engine, GREEDY)
    # 4 others (the interpreter is slow), their prompts part-way, and the target's prompt in chunks
    busy = _engine(attention_backend="triton", enable_prefix_caching=False, max_num_batched_tokens=24)
    logits, tokens = _run(busy, GREEDY, others=4, seed=3)
    assert torch.equal(logits, alone) and tokens == alone_tokens


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logits_bitwise_equal_on_cuda() -> None:
    """The GPU path as it runs by default: Triton attention and fused ops, the Triton matmul,
    decode steps replayed from CUDA graphs (the busy runs' decode steps are graphed, the
    chunked and mixed steps eager: both must give the same bits)."""
    engine = _engine(device="cuda")
    runner = engine.runner
    assert runner.kernels.invariant and runner.kernels.attention_backend == "triton" and runner.kernels.fused_ops
    assert runner.graphs is not None
    assert all(m.triton for m in runner.model.modules() if isinstance(m, InvariantLinear))
    _check_invariance("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logits_bitwise_equal_on_cuda_without_triton() -> None:
    """--attention-backend sdpa: the PyTorch path (invariant attention, cuBLAS in row tiles), eager."""
    engine = _engine(device="cuda", attention_backend="sdpa", fused_ops="off")
    assert engine.runner.graphs is None and not engine.runner.kernels.uses_triton
    _check_invariance("cuda", attention_backend="sdpa", fused_ops="off")


def _check_invariance(device: str, **kernels) -> None:
    for params in (GREEDY, SEEDED):
        alone, alone_tokens = _run(_engine(device=device, enable_prefix_caching=False, **kernels), params)
        assert alone.shape[0] == len(alone_tokens) == MAX_TOKENS
        busy = _engine(device=device, enable_prefix_caching=False, **kernels)
        for seed in range(2):
            logits, tokens = _run(busy, params, others=16, seed=seed)
            assert torch.equal(logits, alone) and tokens == alone_tokens
        chunked = _engine(device=device, enable_prefix_caching=False, max_num_batched_tokens=24, **kernels)
        logits, tokens = _run(chunked, params, others=16, seed=5)
        assert torch.equal(logits, alone) and tokens == alone_tokens
        cached = _engine(device=device, enable_prefix_caching=True, **kernels)
        cold, cold_tokens = _run(cached, params)
        warm, warm_tokens = _run(cached, params, others=16, seed=7)  # 4 of its 5 blocks from the cache
        assert cached.last_cached == 64
        assert torch.equal(cold, alone) and torch.equal(warm, alone)
        assert cold_tokens == alone_tokens == warm_tokens


def test_without_the_mode_a_batch_changes_the_logits() -> None:
    """The comparison above is not vacuous: the default path's logits move with the batch."""
    alone, _ = _run(_engine(batch_invariant=False, enable_prefix_caching=False), GREEDY)
    busy, _ = _run(_engine(batch_invariant=False, enable_prefix_caching=False), GREEDY, others=16, seed=0)
    assert not torch.equal(busy, alone)
    assert torch.allclose(busy, alone, atol=1e-3)


def test_sampler_gives_a_row_the_same_token_and_logprobs_in_any_batch() -> None:
    """The sampler has one path for every batch size: a greedy or seeded row's token and logprobs
    do not depend on the rows beside it (their temperatures, top-k/top-p/min-p, seeds)."""
    from common.engine.sampler import Sampler, SampleRow

    g = torch.Generator().manual_seed(0)
    sampler = Sampler(torch.device("cpu"), seed=0)
    target = torch.randn(1, 2048, generator=g) * 3
    rng = random.Random(0)
    for params in (GREEDY, SEEDED, SamplingParams(temperature=0.7, top_k=40, min_p=0.05, seed=3, logprobs=3)):
        alone = sampler(target.clone(), [SampleRow(params, 70)])
        for size in (2, 5, 16):
            others = [SamplingParams(temperature=rng.choice([0.0, 0.5, 1.3]), top_k=rng.choice([0, 5, 50]),
                                     top_p=rng.choice([1.0, 0.8]), seed=rng.choice([None, 1, 2]),
                                     logprobs=rng.choice([None, 0, 7])) for _ in range(size - 1)]
            at = rng.randrange(size)
            logits = torch.randn(size, 2048, generator=g) * 3
            logits[at] = target[0]
            rows = [SampleRow(p, rng.randrange(1, 200)) for p in others]
            rows.insert(at, SampleRow(params, 70))
            out = sampler(logits, rows)
            assert (out.token_ids[at], out.logprobs[at]) == (alone.token_ids[0], alone.logprobs[0])


def test_tensor_parallel_ranks_are_batch_invariant_too() -> None:
    """TP 2 (the row-parallel partial products tiled on each rank, summed by the all-reduce):
    alone and among 16 others, the same bits (not TP 1's: the sum runs in another order)."""
    engine = _engine(tensor_parallel_size=2, enable_prefix_caching=False)
    try:
        alone, alone_tokens = _run(engine, GREEDY)
        busy, busy_tokens = _run(engine, GREEDY, others=16, seed=3)
        assert torch.equal(busy, alone) and busy_tokens == alone_tokens
    finally:
        engine.runner.close()
