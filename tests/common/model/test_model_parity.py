"""Our CausalLM reproduces transformers' logits for every supported family, however the
prompt is split into steps: one prefill, chunked prefill, token-by-token decode, mixed batches."""

from __future__ import annotations

import pytest
import torch

from common.model.loader import load_model
from helpers.hf_checkpoints import FAMILIES, load_hf_model, make_checkpoint
from helpers.paged_cache import PagedCache

RTOL = 1e-4


@pytest.fixture(scope="module", params=FAMILIES)
def models(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    ours, _ = load_model(path)
    return ours, load_hf_model(path)


def reference_logits(hf_model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([ids])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor) -> None:
    err = ((ours - ref).abs().max() / ref.abs().max()).item()
    assert err <= RTOL, f"relative error {err:.2e} > {RTOL}"


def prompt(length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (length,), generator=g).tolist()


@pytest.mark.parametrize("length", [1, 7, 33, 100])
def test_single_prefill_matches_transformers(models, length):
    ours, hf = models
    cache = PagedCache(ours)
    seq = cache.new_seq(prompt(length, length))
    cache.step([(seq, length)])
    assert_close(torch.stack(seq.outputs), reference_logits(hf, seq.token_ids))


@pytest.mark.parametrize("chunks", [[20, 13], [5, 40, 55]])
def test_chunked_prefill_matches_transformers(models, chunks):
    ours, hf = models
    cache = PagedCache(ours)
    seq = cache.new_seq(prompt(sum(chunks), 3))
    for n in chunks:
        cache.step([(seq, n)])
    assert_close(torch.stack(seq.outputs), reference_logits(hf, seq.token_ids))


def test_decode_after_prefill_matches_transformers(models):
    ours, hf = models
    cache = PagedCache(ours)
    seq = cache.new_seq(prompt(30, 4))
    cache.step([(seq, 9)])
    for _ in range(21):
        cache.step([(seq, 1)])
    assert_close(torch.stack(seq.outputs), reference_logits(hf, seq.token_ids))


def test_mixed_batch_matches_transformers(models):
    """Decoders of different lengths batched with a fresh prefill and a continuing chunk."""
    ours, hf = models
    cache = PagedCache(ours)
    seqs = [cache.new_seq(prompt(n, 10 + n)) for n in (12, 25, 17, 6)]
    cache.step([(seqs[0], 10), (seqs[1], 20)])
    cache.step([(seqs[0], 1), (seqs[2], 17), (seqs[1], 1), (seqs[3], 3)])
    cache.step([(seqs[3], 1), (seqs[0], 1), (seqs[1], 4)])
    while any(s.num_cached < len(s.token_ids) for s in seqs):
        cache.step([(s, 1) for s in seqs if s.num_cached < len(s.token_ids)])
    for s in seqs:
        assert_close(torch.stack(s.outputs), reference_logits(hf, s.token_ids))


def test_on_layer_done_sees_each_layers_new_kv(models):
    ours, _ = models
    cache = PagedCache(ours)
    seq = cache.new_seq(prompt(9, 5))
    seen: list[tuple[int, bool]] = []
    slot = seq.block_ids[8 // cache.block_size] * cache.block_size + 8 % cache.block_size

    def on_layer_done(i: int, kv: torch.Tensor) -> None:
        written = kv.view(2, -1, *kv.shape[-2:])[:, slot].abs().sum().item() > 0
        seen.append((i, kv is cache.kv_caches[i] and written))

    cache.step([(seq, 9)], on_layer_done)
    assert seen == [(i, True) for i in range(ours.config.num_layers)]
