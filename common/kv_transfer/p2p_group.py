"""The data plane: one 2-rank point-to-point process group per (producer, consumer) pair.

Built straight on a ``TCPStore`` (no ``init_process_group``), so one process can hold
many pairs. ``gloo`` on CPU or ``nccl`` on CUDA (see transport.py for the choice); the code
path is the same.
The store's wire takes no handshake: a pair's keys live under a secret prefix instead
(``pair_auth.store_prefix``), so a stranger on the store port cannot touch them.
Building the pair (store, communicator, a first round trip) waits at most
``connect_timeout_s``: NCCL sets its communicator up on the first operation, which takes
seconds. Every later operation waits at most ``timeout_s``; any failure marks the pair
broken (gloo closes a pair after a timeout) and the owner rebuilds it for the next request.
"""

from __future__ import annotations

import datetime
import socket
import threading

import torch
import torch.distributed as dist

from common.kv_transfer.config import PairBrokenError

DTYPE_NAMES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
               torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def route_source(peer_host: str) -> str:
    """This host's address on the route to ``peer_host`` (a UDP connect sends nothing)."""
    family, _, _, _, address = socket.getaddrinfo(peer_host, 9, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(address)
        return s.getsockname()[0]


def _make_backend(backend: str, store: dist.Store, rank: int, timeout: datetime.timedelta, store_host: str):
    if backend == "gloo":
        # gloo's default device binds and advertises what the hostname resolves to (often
        # 127.0.0.1): right on one host, unreachable from another. Use the address on the
        # route to the store, which both ranks can reach.
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=route_source(store_host))]
        return dist.ProcessGroupGloo(store, rank, 2, opts)
    if backend == "nccl":
        from torch.distributed import ProcessGroupNCCL  # only on CUDA builds

        opts = ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return ProcessGroupNCCL(store, rank, 2, opts)
    raise ValueError(f"unknown backend {backend!r}")


def host_store(host: str, timeout_s: float) -> dist.TCPStore:
    """The rank-0 side's store on a free port; returns at once (rank 1 joins later)."""
    return dist.TCPStore(host, 0, 2, True, datetime.timedelta(seconds=timeout_s), wait_for_workers=False)


class _Works:
    """The handles of one message's sends or receives."""

    def __init__(self, works: list) -> None:
        self.works = works

    def wait(self, timeout: datetime.timedelta) -> None:
        for work in self.works:
            work.wait(timeout)


class PairGroup:
    """Rank ``rank`` of a 2-rank group. Construction blocks until the peer joins:
    build it on a background thread, never on a serving thread."""

    def __init__(self, backend: str, rank: int, store_host: str, store_port: int,
                 timeout_s: float, store: dist.TCPStore | None = None, device: str = "cpu",
                 connect_timeout_s: float | None = None, prefix: str = "") -> None:
        self.rank, self.peer, self.backend, self.timeout_s = rank, 1 - rank, backend, timeout_s
        self.connect_timeout_s = connect_timeout_s or timeout_s
        self._timeout = datetime.timedelta(seconds=timeout_s)
        connect = datetime.timedelta(seconds=self.connect_timeout_s)
        self._store = store or dist.TCPStore(store_host, store_port, 2, False, connect)
        if prefix:  # the pair's keys under a prefix only its two ranks know (pair_auth.store_prefix)
            self._store = dist.PrefixStore(prefix, self._store)
        self._device = torch.device(device)
        self.broken = False
        self._lock = threading.Lock()
        try:
            # the backend's own timeout bounds its set-up (gloo's connect, NCCL's first
            # communicator); our operations pass their own, shorter one
            self._pg = _make_backend(backend, self._store, rank, max(connect, self._timeout), store_host)
            # One tiny round trip proves both directions work before real data flows; with
            # NCCL it is also what builds the communicator.
            probe = torch.zeros(1, dtype=torch.int64, device=self._device)
            if rank == 0:
                self.send([probe], self.connect_timeout_s)
            else:
                self.recv_into([probe], self.connect_timeout_s)
        except Exception as e:
            self.broken = True
            raise PairBrokenError(f"building the {backend} pair failed: {e}") from e

    def send(self, tensors: list[torch.Tensor], timeout_s: float | None = None) -> None:
        self.wait(self.send_async(tensors), timeout_s)

    def recv_into(self, tensors: list[torch.Tensor], timeout_s: float | None = None) -> None:
        """Receive into ``tensors`` (contiguous, right dtype/shape) in place, in order."""
        self.wait(self.recv_async(tensors), timeout_s)

    def send_async(self, tensors: list[torch.Tensor]) -> _Works:
        """Post one send per tensor; keep them alive until :meth:`wait`."""
        return _Works([self._post(self._pg.send, t) for t in tensors])

    def recv_async(self, tensors: list[torch.Tensor]) -> _Works:
        """Post one receive per tensor, in order."""
        return _Works([self._post(self._pg.recv, t) for t in tensors])

    def wait(self, work: _Works, timeout_s: float | None = None) -> None:
        timeout = datetime.timedelta(seconds=timeout_s) if timeout_s else self._timeout
        try:
            work.wait(timeout)
        except Exception as e:
            self.broken = True
            raise PairBrokenError(f"{self.backend} transfer failed: {e}") from e

    def _post(self, op, tensor: torch.Tensor):
        if self.broken:
            raise PairBrokenError("pair is broken; rebuild it")
        if not tensor.is_contiguous():
            raise ValueError("data-plane tensors must be contiguous")
        try:
            return op([tensor], self.peer, 0)
        except Exception as e:
            self.broken = True
            raise PairBrokenError(f"{self.backend} transfer failed: {e}") from e

    def close(self) -> None:
        """Drop the group and store; pending operations on the peer fail."""
        self.broken = True
        pg, self._pg = getattr(self, "_pg", None), None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # best effort on an already-failed group
                pass
        self._store = None
