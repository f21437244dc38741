"""Batch invariance of the forward pass's ops (``--batch-invariant``), with 1 and 2 threads.

Each op must give every row the same bits whatever rows share its call: ``rows_invariant``
compares slices of many sizes and offsets with the whole. The tiled linears and the invariant
attention are what the mode adds; the plain ops (RMSNorm, rotary, SiLU-and-mul, embedding,
softmax) are checked to need nothing. The invariant attention matches SDPA within 1e-5 and is
bitwise the same for one sequence however its queries are chunked, prefill or decode, and
whatever sequences share the step.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
import torch.nn.functional as F

from common.model.attention_metadata import AttentionMetadata
from common.model.attn_backends.invariant import InvariantBackend
from common.model.attn_backends.sdpa import SdpaBackend
from common.model.batch_invariant import (
    PACKED_TILES,
    TILES,
    bmm_invariant,
    choose_packed_tile,
    choose_tile,
    pack_weight,
    packed_linear,
    packs_weights,
    padded_rows,
    rows_invariant,
    tiled_linear,
)
from common.model.layers import RMSNorm, apply_rotary
from helpers.random_paged import random_step

# the embedded model's and SmolLM2-135M's widths: (in, out) of their projections
SHAPES = [(256, 704), (704, 256), (256, 2048), (576, 1536), (1536, 576), (576, 192), (576, 49152)]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def test_tiled_linear_gives_every_row_the_same_bits_for_any_batch(threads: int) -> None:
    tile = choose_tile((256, 576), torch.device("cpu"), torch.float32)
    assert tile in TILES
    g = torch.Generator().manual_seed(0)
    for k, n in SHAPES:
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        x = torch.randn(130, k, generator=g)
        assert rows_invariant(lambda rows: tiled_linear(rows, w, b, tile), x), (k, n)
        assert torch.allclose(tiled_linear(x, w, b, tile), F.linear(x, w, b), atol=1e-4)


@pytest.mark.skipif(not packs_weights(torch.device("cpu"), torch.float32), reason="needs torch's oneDNN")
def test_packed_linear_gives_every_row_the_same_bits_for_any_batch(threads: int) -> None:
    """The CPU float32 path: oneDNN on packed weights, rows padded to the tile (and, past 64 rows,
    to a sixteenth of their power of two: the 300-row whole runs as 320)."""
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) for k, n in SHAPES]
    tile = choose_packed_tile(weights)
    assert tile in PACKED_TILES
    for w in weights:
        b, x = torch.randn(w.shape[0], generator=g), torch.randn(300, w.shape[1], generator=g)
        packed = pack_weight(w, tile)
        assert rows_invariant(lambda rows: packed_linear(rows, packed, b, w.shape[0], tile), x), tuple(w.shape)
        assert torch.allclose(packed_linear(x, packed, b, w.shape[0], tile), F.linear(x, w, b), atol=1e-4)


def test_padded_rows_are_few_shapes() -> None:
    assert [padded_rows(n, 4) for n in (1, 4, 5, 64, 65, 100, 130, 300, 1000, 2049)] == [
        4, 4, 8, 64, 72, 104, 144, 320, 1024, 2304]
    assert [padded_rows(n, 16) for n in (1, 17, 65)] == [16, 32, 80]


def test_plain_linear_is_not_batch_invariant() -> None:
    """Why the mode tiles: one row alone (a gemv) rounds differently from the same row among others."""
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(1536, 576, generator=g), torch.randn(64, 576, generator=g)
    assert not rows_invariant(lambda rows: F.linear(rows, w), x)


def test_row_wise_ops_need_no_replacing(threads: int) -> None:
    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    x = torch.randn(130, 576, generator=g)
    assert rows_invariant(norm, x)
    head_norm = RMSNorm(64, 1e-5)
    assert rows_invariant(lambda rows: head_norm(rows.view(-1, 9, 64)), x)  # q/k norm over heads
    cos_sin = torch.randn(130, 64, generator=g)
    both = torch.cat([x, cos_sin], dim=1)  # each row carries its own angles
    assert rows_invariant(lambda r: apply_rotary(r[:, :576].reshape(-1, 9, 64), *r[:, 576:, None].transpose(1, 2)
                                                 .chunk(2, dim=-1)), both)
    gate_up = torch.randn(130, 2 * 1536, generator=g)
    assert rows_invariant(lambda r: F.silu(r[:, :1536]) * r[:, 1536:], gate_up)
    table = torch.randn(49152, 576, generator=g)
    assert rows_invariant(lambda ids: F.embedding(ids, table), torch.randint(0, 49152, (130,), generator=g))
    logits = torch.randn(130, 49152, generator=g) * 4
    for op in (torch.log_softmax, torch.softmax):
        assert rows_invariant(lambda r: op(r, dim=-1), logits)
    assert rows_invariant(lambda r: r.argmax(dim=-1), logits)


def test_attention_bmm_is_batch_count_invariant(threads: int) -> None:
    for group in (1, 2, 3):  # scores [rows, d] @ [d, key block], then p [rows, key block] @ [key block, d]
        assert bmm_invariant((16 * group, 64, 64), torch.device("cpu"), torch.float32)


def test_invariant_attention_matches_sdpa() -> None:
    # decodes, a fresh prompt, a chunk over cached context, GQA groups of 2
    query_lens, seq_lens = [1, 1, 37, 20, 1], [5, 130, 37, 90, 64]
    cache, k, v, meta, g = random_step(query_lens, seq_lens, kv_heads=2, head_dim=64, block_size=16)
    q = torch.randn(sum(query_lens), 4, 64, generator=g)
    scale = 64**-0.5
    ref = SdpaBackend().forward(q, k, v, cache, SdpaBackend().plan(meta, q.device), scale)
    inv = InvariantBackend()
    out = inv.forward(q, k, v, cache, inv.plan(meta, q.device), scale)
    assert (out - ref).abs().max() < 1e-5


class OneSequence:
    """A 150-token sequence in a scattered paged cache, plus room for other sequences."""

    def __init__(self, heads: int = 6, kv_heads: int = 2, length: int = 150, bs: int = 16,
                 backend=InvariantBackend) -> None:
        g = torch.Generator().manual_seed(3)
        self.bs, self.heads, self.length, self.backend = bs, heads, length, backend
        self.cache = torch.randn(2, 40, bs, kv_heads, 64, generator=g)
        order = torch.randperm(40, generator=g).tolist()
        self.table = order[:10]  # 160 slots for the sequence
        self.others = [order[10 + 5 * i : 15 + 5 * i] for i in range(6)]  # 80 slots each
        self.q = torch.randn(length, heads, 64, generator=g)
        self.g = g

    def attend(self, start: int, end: int, others: list[tuple[int, int]] = ()) -> torch.Tensor:
        """Rows ``start..end`` of the sequence as one step's chunk, after ``others`` ((query_len,
        seq_len) of other sequences in the same step); returns the sequence's rows."""
        query_lens, seq_lens, tables, qs = [], [], [], []
        for i, (ql, sl) in enumerate(others):
            query_lens.append(ql), seq_lens.append(sl), tables.append(self.others[i] + [0] * 5)
            qs.append(torch.randn(ql, self.heads, 64, generator=self.g))
        query_lens.append(end - start), seq_lens.append(end), tables.append(self.table)
        qs.append(self.q[start:end])
        meta = AttentionMetadata(slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
                                 query_lens=query_lens, seq_lens=seq_lens, block_tables=torch.tensor(tables),
                                 block_size=self.bs)
        backend = self.backend()
        out = backend.forward(torch.cat(qs), None, None, self.cache, backend.plan(meta, torch.device("cpu")),
                              64**-0.5)
        return out[-(end - start):]


@pytest.mark.parametrize("kv_heads", [1, 2, 6])
def test_invariant_attention_is_bitwise_the_same_however_chunked_and_batched(threads: int, kv_heads: int) -> None:
    _check_one_sequence(OneSequence(kv_heads=kv_heads))


def _check_one_sequence(s: OneSequence) -> None:
    whole = s.attend(0, s.length)
    chunked = torch.cat([s.attend(a, b) for a, b in [(0, 5), (5, 22), (22, 23), (23, 100), (100, 150)]])
    assert torch.equal(chunked, whole)
    decodes = torch.cat([s.attend(p, p + 1) for p in range(120, 150)])  # each as a decode step
    assert torch.equal(decodes, whole[120:])
    busy = s.attend(100, 150, others=[(1, 70), (33, 33), (1, 3), (10, 80)])
    assert torch.equal(busy, whole[100:])
    for p in (0, 64, 127, 149):  # alone, among decodes, among prefills
        assert torch.equal(s.attend(p, p + 1, others=[(1, 79), (1, 2)]), whole[p : p + 1])
        assert torch.equal(s.attend(p, p + 1, others=[(40, 60)]), whole[p : p + 1])


def test_units_in_groups_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long chunk's tiles attend in groups of at most MAX_GATHERED_KEYS keys: the same bits as all at once."""
    from common.model.attn_backends import invariant

    s = OneSequence()
    whole = s.attend(0, s.length, others=[(33, 33), (1, 70)])
    monkeypatch.setattr(invariant, "MAX_GATHERED_KEYS", 200)  # one unit of 192 keys a group
    assert torch.equal(s.attend(0, s.length, others=[(33, 33), (1, 70)]), whole)


# ---- the GPU path's kernels (Triton), in Triton's interpreter: the same source the GPU compiles
needs_interpreter = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where triton is installed)")


@needs_interpreter
@pytest.mark.parametrize("kv_heads", [1, 2])
def test_triton_attention_in_its_invariant_tiling_is_bitwise_the_same_however_chunked_and_batched(
        kv_heads: int) -> None:
    """Decode steps included: they run prefill's tile shape (the default's 16-row decode tile is
    what the invariant tiling drops)."""
    from common.model.attn_backends.triton_paged import TritonBackend

    _check_one_sequence(OneSequence(kv_heads=kv_heads, backend=lambda: TritonBackend(invariant=True)))


@needs_interpreter
def test_triton_matmul_computes_the_linear() -> None:
    """Its row invariance is a GPU matter: numpy's matmul, which the interpreter runs, rounds a
    row differently in different rows of a tile, so here the start-up check fails and the engine
    takes row tiles instead (``test_an_interpreter_engine_checks_the_triton_matmul_and_falls_back``)."""
    from common.model.invariant_matmul import invariant_linear

    g = torch.Generator().manual_seed(0)
    for k, n in SHAPES[:3] + [(96, 200)]:  # and widths no tile divides
        w, b = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
        x = torch.randn(70, k, generator=g)
        assert torch.allclose(invariant_linear(x, w, b), F.linear(x, w, b), atol=1e-4)
        assert torch.allclose(invariant_linear(x[:, None], w, None), F.linear(x, w)[:, None], atol=1e-4)
        assert invariant_linear(x[:0], w, b).shape == (0, n)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("triton") is None,
                    reason="needs CUDA and triton")
def test_triton_matmul_gives_every_row_the_same_bits_on_cuda() -> None:
    from common.model.batch_invariant import triton_rows_invariant
    from common.model.invariant_matmul import invariant_linear

    g = torch.Generator().manual_seed(0)
    shapes = SHAPES + [(896, 4864), (4864, 896), (4096, 14336)]  # Qwen2.5-0.5B's MLP, Llama-3.1-8B's
    weights = [torch.randn(n, k, generator=g).to("cuda", torch.bfloat16) for k, n in shapes]
    assert triton_rows_invariant(weights)
    x = torch.randn(70, 896, generator=g).to("cuda", torch.bfloat16)
    ref = F.linear(x.float(), weights[-3].float())
    assert (invariant_linear(x, weights[-3], None).float() - ref).abs().max() < 0.05 * ref.abs().max()


@needs_interpreter
@pytest.mark.parametrize("passes", [False, True], ids=["check-fails", "check-passes"])
def test_the_linears_take_the_triton_matmul_only_when_its_check_passes(monkeypatch: pytest.MonkeyPatch,
                                                                       passes: bool) -> None:
    """Where nothing packs (a GPU), ``--batch-invariant`` with Triton attention checks the Triton
    matmul at start: it passes on a GPU; in the interpreter it fails (numpy, above), and the
    linears take row tiles. Both ways the engine answers."""
    from common.engine.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.engine.sampling_params import SamplingParams
    from common.model import batch_invariant
    from common.model.batch_invariant import InvariantLinear

    monkeypatch.setattr(batch_invariant, "packs_weights", lambda device, dtype: False)
    if passes:  # (the large tiles' own check is the GPU's to make: 300-row products are slow here)
        monkeypatch.setattr(batch_invariant, "triton_rows_invariant", lambda weights: True)
        monkeypatch.setattr("common.model.invariant_matmul.large_tiles_agree", lambda weights: False)
    engine = LLMEngine(EngineConfig(model="embedded", batch_invariant=True, attention_backend="triton",
                                    num_kv_blocks=64, block_size=16))
    linears = [m for m in engine.runner.model.modules() if isinstance(m, InvariantLinear)]
    assert linears and all(m.triton is passes and m.packed is None for m in linears)
    assert all(m.tile in TILES for m in linears) if not passes else True
    assert len(engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))[0]) == 2
