"""The paged KV cache layout both sides of a transfer must agree on.

One tensor per layer, shaped ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (the model
runner's are slices of one allocation: :func:`block_major` views them block by block)
(index 0 = keys, 1 = values). A request's KV for one layer is
``kv_layer[:, block_ids]`` — ``[2, len(block_ids), block_size, num_kv_heads, head_dim]``.
Prefill and decode nodes pair only when their fingerprints are equal; ``diff`` names
what differs so a refused handshake can say why.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import torch

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: str  # a key of DTYPES

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def layer_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (2, num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def block_shape(self) -> tuple[int, ...]:
        """One block of every layer, ``[layers, 2, block_size, kv_heads, head_dim]`` (how the KV tiers
        and the peer tier hold a block)."""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    def bytes_per_block_per_layer(self) -> int:
        elem = torch.empty((), dtype=self.torch_dtype).element_size()
        return 2 * self.block_size * self.num_kv_heads * self.head_dim * elem

    def fingerprint(self) -> str:
        text = ",".join(f"{k}={v}" for k, v in sorted(asdict(self).items()))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> KVLayout:
        return cls(**{k: d[k] for k in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype")})

    def diff(self, other: KVLayout) -> list[str]:
        """Human-readable differences, e.g. ``["head_dim: 64 != 128"]``; empty when equal."""
        mine, theirs = asdict(self), asdict(other)
        return [f"{k}: {mine[k]} != {theirs[k]}" for k in mine if mine[k] != theirs[k]]


def block_major(kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The pool as one ``[blocks, layers, 2, block_size, kv_heads, head_dim]`` view, when its layers
    (``[2, blocks, ...]`` each) are equally spaced slices of one allocation, as the model runner makes
    them; else None. Over it a gather or a scatter of any blocks is one kernel, not one per layer
    (the KV tiers: 24 indexing calls per copy held the host tier at 0.4x a pinned ``copy_`` on an H200;
    a CUDA-IPC transfer of every layer: one copy instead of one per layer)."""
    first = kv_caches[0]
    step = kv_caches[1].storage_offset() - first.storage_offset() if len(kv_caches) > 1 else first.numel()
    same = all(c.shape == first.shape and c.stride() == first.stride() and c.dtype == first.dtype
               and c.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
               and c.storage_offset() == first.storage_offset() + i * step for i, c in enumerate(kv_caches))
    if not same or step < first.numel():
        return None
    kv_stride, block_stride, *rest = first.stride()
    return first.as_strided((first.shape[1], len(kv_caches), first.shape[0], *first.shape[2:]),
                            (block_stride, step, kv_stride, *rest))
