"""The engine's one typed configuration object (``EngineConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_KV_CACHE_GB = 0.5  # default KV budget on CPU when num_kv_blocks is not given
GPU_KV_CACHE_FRACTION = 0.85  # share of free GPU memory (after loading) given to the KV cache


class EngineConfigError(ValueError):
    """A setting is invalid; the message says which and why."""


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory; None = the embedded default model
    served_model_name: str | None = None
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    block_size: int = 16
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_gb / free GPU memory
    kv_cache_memory_gb: float | None = None  # None: 0.5 GB on CPU, 85% of free memory on GPU
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget; longer prefills are chunked
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise EngineConfigError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise EngineConfigError(f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise EngineConfigError(f"{name} must be >= 1")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise EngineConfigError("num_kv_blocks must be >= 1")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise EngineConfigError("device=cuda but CUDA is not available")
        return torch.device(self.device)

    def resolved_dtype(self) -> str:
        """The KV/compute dtype name: float32 on CPU (no fast bf16 here), bfloat16 on GPU."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.resolved_device().type == "cpu" else "bfloat16"
