"""Tensor-parallel model shards, all ranks in this process (one thread each over a HashStore):
the joined shards give the single-process model's logits, each rank holding only its part."""

from __future__ import annotations

import threading
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from common.engine.tp_group import TPGroup
from common.model.attention_metadata import AttentionMetadata
from common.model.loader import load_model
from common.model.config import ModelConfig
from common.model.embedded import ensure_embedded_model
from common.model.tensor_parallel import TensorParallelError, TPShard, check_split

PROMPT = [3, 17, 42, 5, 9, 100, 7, 250, 31]


def _logits(model) -> torch.Tensor:
    """Prefill ``PROMPT`` into a fresh one-block cache; the logits of every position."""
    attn = model.model.layers[0].self_attn
    caches = [torch.zeros(2, 2, 16, attn.num_kv_heads, attn.head_dim) for _ in model.model.layers]
    n = len(PROMPT)
    meta = AttentionMetadata(slot_mapping=torch.arange(n), query_lens=[n], seq_lens=[n],
                             block_tables=torch.tensor([[0]]), block_size=16)
    with torch.inference_mode():
        return model.compute_logits(model(torch.tensor(PROMPT), torch.arange(n), caches, meta))


def _ranks(path, size: int) -> list[tuple[torch.Tensor, torch.nn.Module]]:
    """Every rank's logits and model, the ranks run as threads."""
    store, results, errors = dist.HashStore(), [None] * size, []

    def rank(r: int) -> None:
        group = TPGroup(store, r, size, torch.device("cpu"), timeout_s=30)
        try:
            model, _ = load_model(path, tp=TPShard(r, size, group))
            results[r] = (_logits(model), model)
        except Exception as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
        finally:
            group.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("family,size", [("qwen2", 2), ("llama", 4)])
def test_shards_join_to_the_whole_model(checkpoint_dir, family, size):
    # qwen2: q/k/v bias, untied head; llama: tied embeddings, and 4 ranks over its 2 KV heads
    # (each KV head replicated on two ranks).
    path = checkpoint_dir(family)
    whole, _ = load_model(path)
    expected = _logits(whole)
    for logits, model in _ranks(path, size):
        assert logits.shape == expected.shape
        torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
        attn = model.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (4 // size, max(1, 2 // size))
        shard_bytes = sum(p.numel() for p in model.parameters())
        assert shard_bytes < sum(p.numel() for p in whole.parameters()) / size * 1.5


@pytest.mark.parametrize("size,words", [(3, "3 does not divide the model's 4 attention heads"),
                                        (8, "8 does not divide the model's 4 attention heads")])
def test_a_size_the_heads_do_not_split_over_is_refused(checkpoint_dir, size, words):
    with pytest.raises(TensorParallelError, match=words):
        load_model(checkpoint_dir("qwen2"), tp=TPShard(0, size, None))


def test_kv_heads_and_ranks_that_do_not_divide_either_way_are_refused():
    config = ModelConfig.from_dir(ensure_embedded_model())
    with pytest.raises(TensorParallelError, match="size 3 and the model's 4 KV heads do not divide one another"):
        check_split(replace(config, num_heads=12, num_kv_heads=4, intermediate_size=96), 3)
