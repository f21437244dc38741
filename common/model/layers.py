"""Building blocks shared by every supported decoder: RMSNorm, rotary embedding, gated MLP.

Parameters that the checkpoint stores split but we keep packed (``gate_up_proj``) carry a
``weight_loader`` so the loader can copy each checkpoint shard into its slice.

RMSNorm, the rotary embedding and SiLU-and-mul can each run as one fused Triton kernel
(``fused_ops``) instead of several element-wise ones. Whether they do is the engine's choice
(``--fused-ops``, on for CUDA by default), set once on the model; the model hands the kernels
module down through each forward (``fused``), and None means the PyTorch ops. Only
:func:`load_fused_ops` imports them, so a model that runs without them never loads them.
"""

from __future__ import annotations

import math
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from common.model.tensor_parallel import TPShard, row_parallel


def load_fused_ops() -> ModuleType:
    """The fused Triton kernels (``common.model.fused_ops``); imports triton, so call it only when they run."""
    from common.model import fused_ops

    return fused_ops


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in float32, as the reference models do."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        if fused is not None and x.dim() in (2, 3) and x.stride(-1) == 1:
            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    original = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = original / low, original / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse rotary frequencies, with the scalings pdserve supports applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":  # a GGUF's rope_freqs tensor: the divisor of each frequency, precomputed
        return inv_freq / torch.tensor(scaling["freq_factors"], dtype=torch.float32)
    raise NotImplementedError(f"rope scaling type {kind!r} is not supported (supported: llama3, linear, freq_factors)")


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embedding: a cos/sin table for every position, shared by all layers."""

    def __init__(
        self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        table = torch.empty(max_positions, head_dim)
        self.register_buffer("cos_sin", table, persistent=False)
        if table.device.type != "meta":  # built on meta, ``materialize`` computes it on the real device:
            self.reset_table(table.device)  # the maths on meta would import torch._dynamo (seconds of CPU)

    def _table(self, device: torch.device | None = None) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        return torch.cat([freqs.cos(), freqs.sin()], dim=-1)  # [max_positions, head_dim]

    def reset_table(self, device: torch.device) -> None:
        """Recompute the table on ``device`` (it is not in the checkpoint, so meta-built models need this)."""
        self.cos_sin = self._table(device)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [n, 1, d / 2] for the tokens at ``positions``; see ``apply_rotary``."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: ModuleType | None = None
) -> torch.Tensor:
    """Rotate ``x`` [n, heads, d] (first half / second half pairs), computing in float32."""
    if fused is not None and x.stride(-1) == 1:
        return fused.apply_rotary(x, cos, sin)
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    return out.to(x.dtype)


class GatedMLP(nn.Module):
    """SiLU-gated MLP with gate and up projections packed into one matmul.

    Under tensor parallelism ``intermediate_size`` is this rank's share: gate/up are its
    columns, down_proj its rows, summed over the ranks (``tensor_parallel.row_parallel``)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPShard | None = None) -> None:
        super().__init__()
        self.tp = tp or TPShard()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self.bind_weight_loaders()

    def bind_weight_loaders(self) -> None:
        """Attach the packed parameter's loader (again after ``to_empty``, which drops attributes)."""
        self.gate_up_proj.weight.weight_loader = self._load_gate_up  # type: ignore[attr-defined]

    def _load_gate_up(self, param: torch.Tensor, loaded: torch.Tensor, shard: int) -> None:
        size = self.intermediate_size
        param.data[shard * size : (shard + 1) * size].copy_(loaded)

    def forward(self, x: torch.Tensor, fused: ModuleType | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if fused is not None and gate_up.dim() == 2:
            return row_parallel(self.down_proj, fused.silu_and_mul(gate_up), self.tp)
        gate, up = gate_up.chunk(2, dim=-1)
        return row_parallel(self.down_proj, F.silu(gate) * up, self.tp)
