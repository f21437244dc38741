"""The engine's one typed configuration object (``EngineConfig``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_KV_CACHE_GB = 0.5  # default KV budget on CPU when num_kv_blocks is not given


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
    kv_cache_memory_gb: float | None = None  # None: 0.5 GB on CPU, from gpu_memory_utilization on GPU
    gpu_memory_utilization: float | None = None  # share of the GPU's total memory; None: 0.9 (gpu_memory.py)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512  # per-step token budget; longer prefills are chunked
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True  # reuse the KV of full blocks whose prefix was seen before
    seed: int = 0
    enforce_eager: bool = False  # no CUDA graphs for decode steps
    attention_backend: str = "auto"  # auto (triton on CUDA when installed, else sdpa) | sdpa | triton
    fused_ops: str = "auto"  # auto (on for CUDA when triton is installed) | on | off: Triton RMSNorm/rotary/SiLU
    # while sequences decode, a step carries at most the prompt tokens this many ms of measured
    # prefill compute allow (a decode node's local prefills); None: only max_num_batched_tokens
    max_local_prefill_stall_ms: float | None = None

    def __post_init__(self) -> None:
        if self.device not in ("auto", "cpu", "cuda"):
            raise EngineConfigError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise EngineConfigError(f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise EngineConfigError(f"{name} must be >= 1")
        if self.attention_backend not in ("auto", "sdpa", "triton"):
            raise EngineConfigError(
                f"attention_backend must be auto, sdpa or triton, not {self.attention_backend!r}"
            )
        if self.fused_ops not in ("auto", "on", "off"):
            raise EngineConfigError(f"fused_ops must be auto, on or off, not {self.fused_ops!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise EngineConfigError("num_kv_blocks must be >= 1")
        if self.max_local_prefill_stall_ms is not None and self.max_local_prefill_stall_ms <= 0:
            raise EngineConfigError("max_local_prefill_stall_ms must be > 0")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise EngineConfigError("gpu_memory_utilization must be in (0, 1]")

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
