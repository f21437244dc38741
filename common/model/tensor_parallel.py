"""Tensor parallelism inside the model: which slice of each weight a rank holds, and the
collectives that join the slices' results.

A rank of ``N`` holds (Megatron's split):
- attention: its ``num_heads / N`` query heads and the KV heads they read. With at least as
  many KV heads as ranks each rank holds ``num_kv_heads / N`` of them; with fewer, a KV head
  is replicated on the ``N / num_kv_heads`` ranks whose query heads share it. q/k/v (and
  gate/up) are column-parallel: each rank computes its own output columns, no communication.
- o_proj and down_proj are row-parallel: each rank multiplies its input slice, one
  all-reduce sums the partial outputs, the bias (held whole) is added once after it.
- the embedding and the LM head are vocab-parallel: a rank holds ``ceil(vocab / N)`` rows
  (the last rank's tail zero-padded). A token outside a rank's rows embeds to zero there and
  one all-reduce sums the lookups; the head's logits are all-gathered and the padding cut.

``TPShard()`` (size 1, no collectives) is the single-process model: every layer then runs the
plain ``nn.Linear`` / ``nn.Embedding`` call, as without tensor parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from common.model.batch_invariant import ProductLinear
from common.model.config import ModelConfig, ModelLoadError


class TensorParallelError(ModelLoadError):
    """The model cannot be split over this many ranks; the message names both numbers."""


class Collectives(Protocol):
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """The element-wise sum of ``tensor`` over the ranks (in place where it can)."""

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the last dim, in rank order."""


@dataclass(frozen=True)
class TPShard:
    """This process's place in the tensor-parallel group: rank ``rank`` of ``size``."""

    rank: int = 0
    size: int = 1
    comm: Collectives | None = None  # None when size is 1


@dataclass(frozen=True)
class ShardSizes:
    """What rank ``rank`` holds of a model: heads, KV heads (from ``kv_start``), MLP and vocab rows."""

    num_heads: int
    num_kv_heads: int
    kv_start: int  # the first KV head this rank holds
    intermediate_size: int
    vocab_start: int
    vocab_rows: int  # rows this rank's embedding / head have (ceil(vocab / size), padded)


def check_split(config: ModelConfig, size: int) -> None:
    """TensorParallelError unless ``config``'s heads and MLP split evenly over ``size`` ranks."""
    if size == 1:
        return
    flag = f"--tensor-parallel-size {size}"
    if config.num_heads % size:
        raise TensorParallelError(f"{flag} does not divide the model's {config.num_heads} attention heads; "
                                  "choose a size that divides it")
    kv = config.num_kv_heads
    if kv % size and size % kv:
        raise TensorParallelError(f"{flag} and the model's {kv} KV heads do not divide one another (a rank "
                                  "holds KV heads / size of them, or shares one KV head with size / KV heads ranks)")
    if config.intermediate_size % size:
        raise TensorParallelError(f"{flag} does not divide the model's intermediate size "
                                  f"{config.intermediate_size}")


def shard_sizes(config: ModelConfig, tp: TPShard) -> ShardSizes:
    rows = -(-config.vocab_size // tp.size)
    kv = config.num_kv_heads
    return ShardSizes(
        num_heads=config.num_heads // tp.size,
        num_kv_heads=max(1, kv // tp.size),
        kv_start=tp.rank * kv // tp.size,  # with replication, the KV head this rank's query heads read
        intermediate_size=config.intermediate_size // tp.size,
        vocab_start=tp.rank * rows,
        vocab_rows=rows,
    )


def checkpoint_slice(name: str, config: ModelConfig, tp: TPShard) -> tuple[int, int, int] | None:
    """``(dim, start, stop)`` of checkpoint tensor ``name`` that this rank loads; None = all of it."""
    if tp.size == 1:
        return None
    s, d = shard_sizes(config, tp), config.head_dim
    q_rows = (tp.rank * s.num_heads * d, (tp.rank + 1) * s.num_heads * d)
    mlp_rows = (tp.rank * s.intermediate_size, (tp.rank + 1) * s.intermediate_size)
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return (0, *q_rows)
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return 0, s.kv_start * d, (s.kv_start + s.num_kv_heads) * d
    if name.endswith("o_proj.weight"):
        return (1, *q_rows)
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return (0, *mlp_rows)
    if name.endswith("down_proj.weight"):
        return (1, *mlp_rows)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 0, s.vocab_start, min(s.vocab_start + s.vocab_rows, config.vocab_size)
    return None  # norms, o_proj's bias: whole on every rank


def row_parallel(linear: nn.Linear, x: torch.Tensor, tp: TPShard) -> torch.Tensor:
    """``linear(x)`` where ``x`` and ``linear``'s input columns are this rank's slice: partial
    products summed over the ranks, then the (whole) bias once."""
    if tp.comm is None:
        return linear(x)
    partial = linear.matmul(x) if isinstance(linear, ProductLinear) else F.linear(x, linear.weight)
    out = tp.comm.all_reduce(partial)
    return out if linear.bias is None else out + linear.bias


def embed(embedding: nn.Embedding, ids: torch.Tensor, tp: TPShard) -> torch.Tensor:
    """The embeddings of ``ids`` from a vocab-parallel table (rows ``tp.rank * rows`` on)."""
    if tp.comm is None:
        return embedding(ids)
    rows = embedding.weight.shape[0]
    local = ids - tp.rank * rows
    outside = (local < 0) | (local >= rows)
    out = F.embedding(local.masked_fill(outside, 0), embedding.weight)
    return tp.comm.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


def logits(head: nn.Linear, hidden: torch.Tensor, tp: TPShard, vocab_size: int) -> torch.Tensor:
    """Float32 logits [n, vocab] from a vocab-parallel head: each rank's columns, gathered."""
    if tp.comm is None:
        return head(hidden).float()
    return tp.comm.all_gather(head(hidden).float().contiguous())[:, :vocab_size]
