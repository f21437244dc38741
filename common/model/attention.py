"""The attention interface: one backend per engine, chosen at start, shared by every layer.

A backend turns the step's ``AttentionMetadata`` into a plan once per forward (tensors every
layer reuses), then attends each layer's queries against the paged cache through that plan.
Every layer first stores its new K/V with ``write_kv``; attention then reads all keys, old and
new, from the cache.

- ``sdpa`` (CPU default; CUDA fallback): gathers blocks into padded tensors and calls
  ``scaled_dot_product_attention``. Exact; the reference for the others.
- ``invariant`` (``--batch-invariant`` without Triton; ``attn_backends/invariant.py``): fixed
  query tiles and key blocks in PyTorch ops, so a query's result does not depend on its batch or
  chunk; the model's linears then run in fixed row tiles too (``batch_invariant``). Where Triton
  runs, ``--batch-invariant`` keeps the ``triton`` backend with one tile shape for decode and
  prefill alike (``invariant=True``), the fused ops, CUDA graphs, and a fixed-tile Triton matmul
  for the linears (``invariant_matmul``).
- ``triton`` (CUDA default when Triton is importable): one kernel per layer reads the cache
  through block tables in place, for decode, varlen prefill and chunks over cached context
  alike; its plan is a handful of fixed-shape tensors, so decode steps can be CUDA-graphed.

The engine's whole kernel choice, the backend and whether the fused Triton ops
(``common.model.fused_ops``) replace PyTorch's RMSNorm / rotary / SiLU-and-mul, is one
:class:`KernelChoice`, made by :func:`choose_kernels` from ``--attention-backend`` and
``--fused-ops`` and set on the model with :func:`use_kernels`. Triton compiles a kernel on its
first launch (it needs a C compiler and the Python headers), so the engine warms the choice up
at start and, when that fails, asks :func:`warm_up_fallback` what to run instead.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from common.model.attention_metadata import AttentionMetadata

log = logging.getLogger(__name__)

BACKENDS = ("auto", "sdpa", "triton")
INVARIANT = "invariant"  # not a --attention-backend value: --batch-invariant chooses it
FUSED_OPS = ("auto", "on", "off")
TRITON_HINT = ("Triton compiles its kernels on first use and needs a C compiler and the Python headers "
               "(e.g. apt-get install gcc python3-dev)")


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


def select_backend(name: str, device: torch.device, invariant: bool = False) -> AttentionBackend:
    """The backend for ``name`` ("auto": triton on CUDA when installed, else sdpa); ``invariant``:
    triton's batch-invariant tiling (one tile shape whatever the step holds)."""
    if name == INVARIANT:
        from common.model.attn_backends.invariant import InvariantBackend

        return InvariantBackend()
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, not {name!r}")
    if name == "auto":
        name = "triton" if device.type == "cuda" and triton_available() else "sdpa"
    if name == "triton":
        if not triton_available():
            raise ValueError("attention backend triton needs the triton package (it ships with CUDA torch)")
        from common.model.attn_backends.triton_paged import TritonBackend

        return TritonBackend(invariant)
    from common.model.attn_backends.sdpa import SdpaBackend

    return SdpaBackend()


class TritonStartError(RuntimeError):
    """Triton was asked for by name (``--attention-backend triton``, ``--fused-ops on``) and cannot run."""


@dataclass(frozen=True)
class KernelChoice:
    """The kernels one engine runs, chosen once at start (see the module docstring)."""

    attention_backend: str  # "sdpa" | "triton" | "invariant"
    fused_ops: bool  # the fused Triton RMSNorm / rotary / SiLU-and-mul instead of PyTorch's ops
    required: tuple[str, ...] = ()  # the flags that asked for Triton by name: no fallback for them
    invariant: bool = False  # --batch-invariant: every row's result independent of its batch

    @property
    def uses_triton(self) -> bool:
        return self.attention_backend == "triton" or self.fused_ops


PLAIN = KernelChoice("sdpa", False)  # no Triton anywhere: what a failed Triton warm-up falls back to
# --batch-invariant without Triton: invariant attention, PyTorch ops, linears on oneDNN or in row tiles
BATCH_INVARIANT = KernelChoice(INVARIANT, False, invariant=True)


def choose_kernels(attention_backend: str, fused_ops: str, device: torch.device,
                   batch_invariant: bool = False) -> KernelChoice:
    """``auto`` picks Triton for CUDA when triton is installed; a named choice is kept as asked.
    ``batch_invariant``: the Triton attention in its invariant tiling (with the fused ops as
    chosen) where that choice runs Triton attention, else :data:`BATCH_INVARIANT`.

    Raises :class:`TritonStartError` when a flag names Triton and triton is not installed."""
    if attention_backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, not {attention_backend!r}")
    if fused_ops not in FUSED_OPS:
        raise ValueError(f"fused ops must be one of {', '.join(FUSED_OPS)}, not {fused_ops!r}")
    triton_here = device.type == "cuda" and triton_available()
    backend = ("triton" if triton_here else "sdpa") if attention_backend == "auto" else attention_backend
    fused = triton_here if fused_ops == "auto" else fused_ops == "on"
    required = tuple(flag for flag, named in (("--attention-backend triton", attention_backend == "triton"),
                                              ("--fused-ops on", fused_ops == "on")) if named)
    if required and not triton_available():
        raise TritonStartError(f"{' and '.join(required)} need the triton package (it ships with CUDA builds of "
                               "torch); install it or use auto, which runs without it")
    if device.type == "cuda" and not triton_here:
        log.warning("triton is not installed: CUDA attention falls back to SDPA over gathered blocks "
                    "and the per-layer ops to PyTorch's")
    if batch_invariant:
        return KernelChoice(backend, fused, required, invariant=True) if backend == "triton" else BATCH_INVARIANT
    return KernelChoice(backend, fused, required)


def warm_up_fallback(choice: KernelChoice, error: Exception) -> KernelChoice:
    """What to run after ``choice`` failed its warm-up with ``error``: SDPA and the PyTorch ops when
    Triton was only chosen by ``auto`` (:data:`BATCH_INVARIANT` for an invariant choice). Re-raises
    ``error`` when ``choice`` used no Triton (nothing to fall back from), and raises
    :class:`TritonStartError` when a flag asked for Triton by name."""
    if not choice.uses_triton:
        raise error
    if choice.required:
        raise TritonStartError(
            f"{' and '.join(choice.required)} asked for Triton, but its kernels failed at warm-up "
            f"({type(error).__name__}: {error}). {TRITON_HINT}; or start with --attention-backend auto "
            "--fused-ops auto (falls back to SDPA) or sdpa / off (no Triton)") from error
    return BATCH_INVARIANT if choice.invariant else PLAIN


def use_kernels(model: torch.nn.Module, choice: KernelChoice, device: torch.device) -> None:
    """Set ``choice`` on the model: its attention backend and whether its layers run the fused ops
    (and, for an invariant choice, its linears made batch-invariant: BatchInvariantError when
    this machine has no way to; else, on CPU in float32, its linears on oneDNN)."""
    from common.model.batch_invariant import make_batch_invariant, pack_linears

    if choice.invariant:
        how = make_batch_invariant(model, device, triton=choice.attention_backend == "triton")
        log.info("--batch-invariant: %s attention, linears %s", choice.attention_backend, how)
    elif not choice.uses_triton:  # (Triton on a CPU tensor is the tests' interpreter standing in for a GPU)
        pack_linears(model, device)
    model.attn_backend = select_backend(choice.attention_backend, device, choice.invariant)
    model.use_fused_ops = choice.fused_ops
