"""The paged KV cache layout both sides of a transfer must agree on.

One tensor per layer, shaped ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
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
