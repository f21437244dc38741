"""The tensor-parallel group's collectives: torch c10d process groups built on a store.

Built the way the KV pairs are (``kv_transfer/p2p_group``): a ``ProcessGroupGloo`` (and, on
CUDA, a ``ProcessGroupNCCL``) constructed straight on a ``TCPStore``, no
``init_process_group``. Nothing global is set, so a test can run all ranks of a group in one
process (threads over a ``HashStore``), and a node's ranks need no environment variables.

Two groups, as vLLM keeps them: ``control`` (gloo, CPU tensors) carries rank 0's broadcast of
each step's inputs; ``data`` carries the model's all-reduces and all-gathers on the ranks'
device (the same gloo group on CPU, NCCL on CUDA). A worker waits for its next step on the
control group with no practical time bound (its node may idle for hours; gloo still fails at
once when rank 0's sockets close); every other operation waits at most ``timeout_s``.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions  # not re-exported by torch.distributed

IDLE_WAIT = datetime.timedelta(days=365)  # a worker's wait for its next step


class RankLostError(RuntimeError):
    """A collective failed or timed out: a rank of the tensor-parallel group died or hung."""


def _gloo(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta, host: str) -> dist.ProcessGroup:
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta) -> dist.ProcessGroup:
    from torch.distributed import ProcessGroupNCCL  # only on CUDA builds

    opts = ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return ProcessGroupNCCL(store, rank, size, opts)


class TPGroup:
    """Rank ``rank`` of ``size``: the collectives the model calls (``tensor_parallel.Collectives``)
    and the control broadcast. Construction blocks until every rank has joined."""

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float,
                 host: str = "127.0.0.1") -> None:
        self.rank, self.size, self.device = rank, size, device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.control = _gloo(dist.PrefixStore("control", store), rank, size, self.timeout, host)
        if device.type == "cuda":
            self.data = _nccl(dist.PrefixStore("data", store), rank, size, self.timeout)
        else:
            self.data = self.control

    def _wait(self, work, timeout: datetime.timedelta | None = None) -> None:
        try:
            work.wait(timeout or self.timeout)
        except Exception as exc:
            raise RankLostError(f"a tensor-parallel collective failed (a rank died or hung): {exc}") from exc

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        opts = dist.AllreduceOptions()
        opts.timeout = self.timeout
        self._wait(self.data.allreduce([tensor], opts))
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        opts = AllgatherOptions()
        opts.timeout = self.timeout
        self._wait(self.data.allgather([parts], [tensor], opts))
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """Rank 0's CPU ``tensor`` into every rank's ``tensor`` (same shape and dtype); ``idle``: a
        worker waiting for its next step, with no practical time bound."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        opts.timeout = IDLE_WAIT if idle else self.timeout
        self._wait(self.control.broadcast([tensor], opts), opts.timeout)
        return tensor

    def gather_bytes(self, data: bytes) -> list[bytes]:
        """Every rank's ``data``, in rank order, on every rank (over the control group: a worker's
        report to rank 0 is a few ids, not device data)."""
        opts = AllgatherOptions()
        opts.timeout = self.timeout
        size = torch.tensor([len(data)], dtype=torch.int64)
        sizes = [torch.empty_like(size) for _ in range(self.size)]
        self._wait(self.control.allgather([sizes], [size], opts))
        lengths = [int(s) for s in sizes]
        mine = torch.zeros(max(1, *lengths), dtype=torch.uint8)
        mine[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else mine[:0]
        parts = [torch.empty_like(mine) for _ in range(self.size)]
        self._wait(self.control.allgather([parts], [mine], opts))
        return [bytes(p[:n].numpy()) for p, n in zip(parts, lengths)]

    def close(self) -> None:
        """Drop the groups; a peer's pending operation fails."""
        for pg in {id(self.control): self.control, id(self.data): self.data}.values():
            try:
                pg.shutdown()
            except Exception:  # best effort: the group may already be broken
                pass
