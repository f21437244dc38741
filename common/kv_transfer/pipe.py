"""A FIFO of tensors (or ``None``) over a pair, with in-band dtype/shape metadata.

The contract of vLLM's ``KVPipeBase``: ``send_tensor(t | None)``, ``recv_tensor()``,
``close()``. Each item is a fixed-size int64 header, then the payload bytes. The
lookup buffer builds on it; the transfer engine sends its metadata on the control
plane instead (so an idle pair never waits on a header and times out).
"""

from __future__ import annotations

import torch

from common.kv_transfer.p2p_group import DTYPE_NAMES, PairGroup

MAX_DIMS = 8
_DTYPES = list(DTYPE_NAMES.values())
_HEADER_LEN = 3 + MAX_DIMS  # is_tensor, dtype code, ndim, shape...


class TensorPipe:
    """Send/receive whole tensors over one :class:`PairGroup`. Not thread-safe: one
    sender and one receiver thread at most."""

    def __init__(self, pair: PairGroup, device: str = "cpu") -> None:
        self.pair = pair
        self.device = torch.device(device)

    def send_tensor(self, tensor: torch.Tensor | None) -> None:
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64)
        if tensor is not None:
            if tensor.dim() > MAX_DIMS:
                raise ValueError(f"at most {MAX_DIMS} dims, got {tensor.dim()}")
            header[0], header[1], header[2] = 1, _DTYPES.index(tensor.dtype), tensor.dim()
            header[3:3 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        self.pair.send(header.to(self.device))
        if tensor is not None and tensor.numel() > 0:
            self.pair.send(tensor.to(self.device).contiguous())

    def recv_tensor(self, timeout_s: float | None = None) -> torch.Tensor | None:
        header = torch.zeros(_HEADER_LEN, dtype=torch.int64, device=self.device)
        self.pair.recv_into(header, timeout_s)
        is_tensor, code, ndim, *shape = header.tolist()
        if not is_tensor:
            return None
        out = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=self.device)
        if out.numel() > 0:
            self.pair.recv_into(out, timeout_s)
        return out

    def close(self) -> None:
        self.pair.close()
