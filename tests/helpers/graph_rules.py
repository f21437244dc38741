"""What may run inside a CUDA graph, checked on any device: the rules a captured function must keep.

A CUDA graph records the kernels a function launches and replays them with no Python in between.
So inside the captured function:

- nothing may wait for the device to read a value back (``.item()``, ``bool(t)``, ``.tolist()``,
  ``.cpu()``, ``nonzero``, boolean-mask indexing, ``unique``...): capture fails on a sync, and a
  Python branch on a tensor's value would be frozen at capture time anyway;
- nothing may read host memory (``torch.tensor(list)``, a CPU tensor moved ``.to(device)`` or fed
  to an op): a host-to-device copy replays the bytes the host buffer held at capture, if it is
  captured at all;
- per-step values the host hands in as Python data (``AttentionMetadata.seq_lens``) must not be
  read: replay skips the Python that read them.

``GraphRules.run`` runs the function under a ``TorchFunctionMode`` (it sees ``tolist``, ``numpy``
and ``cpu``, which never reach the dispatcher on CPU) and a ``TorchDispatchMode`` (every aten op,
after composites are decomposed). Host memory is told apart by provenance rather than device,
so the check works on CPU: every tensor an op reads must live in a storage named as device memory
up front (parameters, KV caches, the graph's input buffers) or made by an op inside the function.
A Triton kernel launch is not an aten op; in the CPU interpreter its argument copies are views of
the same storages, so it passes, as it is one node of the graph on a GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_REPO = Path(__file__).resolve().parents[2]
_THIS = Path(__file__).resolve()

# aten ops that read a device value back on the host, or size their output by the data
SYNCING_OPS = {
    "aten::item": "reads a value back on the host (.item(), bool(), int(), float())",
    "aten::_local_scalar_dense": "reads a value back on the host (.item(), bool(), int(), float())",
    "aten::is_nonzero": "reads a value back on the host (Python branch on a tensor)",
    "aten::equal": "reads a value back on the host (torch.equal)",
    "aten::nonzero": "sizes its output by the data (nonzero, argwhere, boolean masks)",
    "aten::masked_select": "sizes its output by the data (masked_select)",
    "aten::unique_consecutive": "sizes its output by the data (unique)",
    "aten::_unique": "sizes its output by the data (unique)",
    "aten::_unique2": "sizes its output by the data (unique)",
    "aten::unique_dim": "sizes its output by the data (unique)",
    "aten::bincount": "sizes its output by the data (bincount)",
    "aten::repeat_interleave": "sizes its output by the data (repeat_interleave of a tensor)",
}
# aten ops that make a tensor out of host data (torch.tensor, as_tensor, from_numpy)
HOST_DATA_OPS = {"aten::lift_fresh", "aten::lift_fresh_copy"}
INDEXING_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}
# Tensor methods that hand data to the host without reaching the dispatcher on CPU (item() and
# bool() do reach it, as aten::_local_scalar_dense)
HOST_READS = {"tolist", "numpy", "cpu", "__array__"}
# Tensor methods that move a tensor to the device: a no-op on CPU, a host-to-device copy from a host tensor
DEVICE_MOVES = {"to", "cuda", "contiguous", "copy_"}


class FrozenAtCapture(list):
    """A host list whose values replay would not see: any read inside ``GraphRules.run`` is a violation."""

    def __init__(self, values: Iterable, name: str, rules: GraphRules) -> None:
        super().__init__(values)
        self.name, self.rules = name, rules

    def _read(self) -> None:
        self.rules.violate(f"reads {self.name}, a host list frozen at capture")

    def __getitem__(self, i):
        self._read()
        return super().__getitem__(i)

    def __iter__(self):  # max(), sum(), list(), for
        self._read()
        return super().__iter__()

    def __add__(self, other):
        self._read()
        return list(super().__iter__()) + other

    def __radd__(self, other):  # tried before list.__add__, which would copy without reading us
        self._read()
        return other + list(super().__iter__())

    def __contains__(self, value):
        self._read()
        return super().__contains__(value)


class GraphRules:
    """Runs a function as it would be captured and lists every rule it breaks (see the module docstring)."""

    def __init__(self, device_tensors: Iterable[torch.Tensor]) -> None:
        self._device = {_storage(t) for t in device_tensors}
        self.violations: list[str] = []
        self._active = False

    def frozen(self, values: Iterable, name: str) -> FrozenAtCapture:
        """``values`` as a list that counts as a violation when the captured function reads it."""
        return FrozenAtCapture(values, name, self)

    def run(self, fn: Callable[[], object]) -> list[str]:
        """Run ``fn`` under the rules; one line per violation: what, why, and where in our code."""
        self._active = True
        try:
            with _FunctionRules(self), _DispatchRules(self), torch.inference_mode():
                fn()
        finally:
            self._active = False
        return self.violations

    def violate(self, what: str) -> None:
        if self._active:
            self.violations.append(f"{what} at {_caller()}")

    def check_reads(self, op: str, tensors: Iterable[torch.Tensor]) -> None:
        for t in tensors:
            if t.numel() and _storage(t) not in self._device:
                self.violate(f"{op} reads host memory (a tensor not on the device before capture nor made in it)")

    def made(self, tensors: Iterable[torch.Tensor]) -> None:
        self._device.update(_storage(t) for t in tensors)


class _FunctionRules(TorchFunctionMode):
    def __init__(self, rules: GraphRules) -> None:
        super().__init__()
        self.rules = rules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.rules.violate(f"Tensor.{name}() hands device data to the host")
        elif name in DEVICE_MOVES:
            source = args[1] if name == "copy_" else args[0]
            self.rules.check_reads(f"Tensor.{name}", [t for t in [source] if isinstance(t, torch.Tensor)])
        return func(*args, **kwargs)


class _DispatchRules(TorchDispatchMode):
    def __init__(self, rules: GraphRules) -> None:
        super().__init__()
        self.rules = rules

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        op = func._schema.name
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if op in SYNCING_OPS:
            self.rules.violate(f"{op} {SYNCING_OPS[op]}")
        elif op in HOST_DATA_OPS:
            self.rules.violate(f"{op} makes a tensor from host data (torch.tensor / as_tensor / from_numpy)")
        elif op in INDEXING_OPS and any(t.dtype in (torch.bool, torch.uint8) for t in _index_tensors(args)):
            self.rules.violate(f"{op} with a boolean mask sizes its output by the data")
        elif op in ("aten::_to_copy", "aten::copy_") and len({t.device for t in inputs} | _target(kwargs)) > 1:
            self.rules.violate(f"{op} copies between devices")
        if op not in HOST_DATA_OPS:
            self.rules.check_reads(op, inputs)
        out = func(*args, **kwargs)
        self.rules.made(a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor))
        return out


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _index_tensors(args: tuple) -> list[torch.Tensor]:
    indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else []
    return [t for t in indices if isinstance(t, torch.Tensor)]


def _target(kwargs: dict) -> set[torch.device]:
    return {torch.device(kwargs["device"])} if kwargs.get("device") is not None else set()


def _caller() -> str:
    """The innermost frame of this repository's code outside this file: where the rule was broken."""
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path != _THIS and path.is_relative_to(_REPO) and ".venv" not in path.parts:
            return f"{path.relative_to(_REPO)}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back
    return "<outside the repository>"
