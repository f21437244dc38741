"""The attention interface: one backend per engine, chosen at start, shared by every layer.

A backend turns the step's ``AttentionMetadata`` into a plan once per forward (tensors every
layer reuses), then attends each layer's queries against the paged cache through that plan.
Every layer first stores its new K/V with ``write_kv``; attention then reads all keys, old and
new, from the cache.

- ``sdpa`` (CPU default; CUDA fallback): gathers blocks into padded tensors and calls
  ``scaled_dot_product_attention``. Exact; the reference for the others.
- ``triton`` (CUDA default when Triton is importable): one kernel per layer reads the cache
  through block tables in place, for decode, varlen prefill and chunks over cached context
  alike; its plan is a handful of fixed-shape tensors, so decode steps can be CUDA-graphed.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Protocol

import torch

from common.model.attention_metadata import AttentionMetadata

log = logging.getLogger(__name__)

BACKENDS = ("auto", "sdpa", "triton")


class AttentionBackend(Protocol):
    name: str
    supports_cuda_graphs: bool  # its plan is fixed-shape device tensors, built without host syncs

    def plan(self, meta: AttentionMetadata, device: torch.device) -> Any:
        """What every layer of this forward shares (indices, masks, metadata tensors)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, plan: Any,
        scale: float,
    ) -> torch.Tensor:
        """``q`` [n, heads, d] and this step's ``k``/``v`` [n, kv_heads, d], already in ``kv_cache``,
        -> [n, heads * d]."""


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store ``k``/``v`` [n, kv_heads, d] at flat slots of ``kv_cache`` [2, blocks, bs, kv_heads, d]."""
    flat = kv_cache.view(2, -1, kv_cache.shape[-2], kv_cache.shape[-1])
    flat[0, slot_mapping] = k.to(kv_cache.dtype)
    flat[1, slot_mapping] = v.to(kv_cache.dtype)


def triton_available() -> bool:
    return importlib.util.find_spec("triton") is not None


def select_backend(name: str, device: torch.device) -> AttentionBackend:
    """The backend for ``name`` ("auto": triton on CUDA when installed, else sdpa)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "sdpa"
        if device.type == "cuda" and name == "sdpa":
            log.warning("triton is not installed: CUDA attention falls back to SDPA over gathered blocks")
    if name == "triton":
        if not triton_available():
            raise ValueError("attention backend triton needs the triton package (it ships with CUDA torch)")
        from common.model.attn_backends.triton_paged import TritonBackend

        return TritonBackend()
    from common.model.attn_backends.sdpa import SdpaBackend

    return SdpaBackend()
