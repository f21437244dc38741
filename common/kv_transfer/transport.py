"""Which data plane a (producer, consumer) pair uses, decided once at the handshake.

Each side says what it has (:class:`Endpoint`: host, device kind, physical GPU) and what
it was told to use (``--kv-transport``). The producer decides with :func:`choose_transport`
and either answers with the choice or refuses the handshake with a message naming the fix,
so a pair that cannot work fails on its first request with that message instead of
later inside NCCL or a socket.

- ``cuda_ipc``: both caches on CUDA and able to share memory; the producer writes straight
  into the consumer's blocks. The only choice on one shared GPU (NCCL refuses two ranks
  there: "Duplicate GPU detected");
- ``nccl``: both on CUDA, different GPUs that cannot share memory (typically two hosts);
- ``tcp``: both on CPU: one socket, zero-copy from and into scattered blocks (auto's CPU
  choice: it beats gloo on the paged path, see bench/kv_transfer.py);
- ``gloo``: both on CPU, through torch's gloo pair (kept as a fallback and for comparison).

What auto compares is the physical device, not the host name: two containers on one
machine have different hostnames but may share a GPU. The rule (:func:`same_gpu`,
:func:`can_share_memory`):

- the same GPU uuid on both sides is one physical GPU, whatever the hosts say: cuda_ipc;
- two GPUs with the same :func:`host_id` (hostname and boot id: one OS instance): cuda_ipc,
  a device-to-device copy; if the producer cannot see the consumer's GPU it falls back to
  nccl (:func:`ipc_fallback`);
- two GPUs under different host ids: nccl. Two containers on one machine, each with its
  own GPU, land here: whether they could share memory depends on namespaces neither side
  can see, and NCCL works between them either way.

The PCI bus id travels too; it names the GPU in messages (an operator finds it in
``nvidia-smi``), the uuid decides.
"""

from __future__ import annotations

import functools
import socket
from dataclasses import asdict, dataclass

import torch

from common.cluster_auth import ClusterKey
from common.kv_transfer.config import TransferError
from common.kv_transfer.streams import StreamOps, stream_ops

TRANSPORTS = ("cuda_ipc", "nccl", "tcp", "gloo")
MODES = ("auto", *TRANSPORTS)
CPU_TRANSPORTS = ("tcp", "gloo")
GPU_TRANSPORTS = ("cuda_ipc", "nccl")


class TransportMismatchError(TransferError):
    """The two sides cannot agree on a data plane; the message says what to change."""


@functools.cache
def host_id() -> str:
    """Names this OS instance (hostname and boot id): two processes with the same id can
    share CUDA memory. Containers on one machine share the boot id, not the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _pci_bus_id(props) -> str:
    """``domain:bus:device.0`` as nvidia-smi prints it; empty where torch does not say."""
    try:
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:
        return ""


@dataclass(frozen=True)
class Endpoint:
    """What one side of a pair brings: its host, where its KV cache lives, its physical GPU."""

    host: str
    device_type: str  # "cpu" | "cuda"
    gpu_uuid: str = ""  # the physical GPU (same uuid in two processes = one shared GPU)
    pci_bus_id: str = ""  # where that GPU sits on its host (for messages; the uuid decides)

    @classmethod
    def local(cls, device: str | torch.device) -> Endpoint:
        dev = torch.device(device)
        uuid = bus = ""
        if dev.type == "cuda":
            props = torch.cuda.get_device_properties(dev)
            uuid, bus = str(props.uuid), _pci_bus_id(props)
        return cls(host_id(), dev.type, uuid, bus)

    def gpu(self) -> str:
        """The GPU in words: its uuid, and its bus id when known."""
        return f"{self.gpu_uuid} ({self.pci_bus_id})" if self.pci_bus_id else self.gpu_uuid

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Endpoint:
        return cls(str(d["host"]), str(d["device_type"]), str(d.get("gpu_uuid", "")),
                   str(d.get("pci_bus_id", "")))


def same_gpu(p: Endpoint, d: Endpoint) -> bool:
    """Both caches on one physical GPU (the uuid is unique across machines)."""
    return p.device_type == d.device_type == "cuda" and bool(p.gpu_uuid) and p.gpu_uuid == d.gpu_uuid


def can_share_memory(p: Endpoint, d: Endpoint) -> bool:
    """Whether CUDA IPC can work between the two: one GPU, or one OS instance."""
    return same_gpu(p, d) or p.host == d.host


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"--kv-transport must be one of {', '.join(MODES)}; got {mode!r}")
    return mode


def choose_transport(p_mode: str, p: Endpoint, d_mode: str, d: Endpoint) -> str:
    """The producer's decision for a pair; raises :class:`TransportMismatchError` naming the fix."""
    check_mode(p_mode)
    check_mode(d_mode)
    if p_mode != "auto" and d_mode != "auto" and p_mode != d_mode:
        raise TransportMismatchError(
            f"KV transport mismatch: prefill has --kv-transport {p_mode}, decode has {d_mode}; "
            "give both the same value, or auto")
    if p.device_type != d.device_type:
        raise TransportMismatchError(
            f"KV caches on different device kinds (prefill {p.device_type}, decode {d.device_type}); "
            "put both on CUDA or both on CPU (--device)")
    mode = p_mode if p_mode != "auto" else d_mode
    if mode == "auto":
        if p.device_type == "cpu":
            return "tcp"
        return "cuda_ipc" if can_share_memory(p, d) else "nccl"
    if p.device_type == "cpu" and mode in GPU_TRANSPORTS:
        raise TransportMismatchError(f"--kv-transport {mode} needs the KV caches on CUDA; these are on CPU: "
                                     "use tcp, gloo or auto")
    if p.device_type == "cuda" and mode in CPU_TRANSPORTS:
        raise TransportMismatchError(f"--kv-transport {mode} moves CPU tensors; these caches are on CUDA: "
                                     "use cuda_ipc (same host), nccl (across hosts) or auto")
    if mode == "cuda_ipc" and not can_share_memory(p, d):
        raise TransportMismatchError("--kv-transport cuda_ipc needs prefill and decode on one host or one GPU; "
                                     f"these are on two hosts ({p.host}, {d.host}): use nccl or auto")
    if mode == "nccl" and same_gpu(p, d):
        raise TransportMismatchError("NCCL cannot pair two ranks on one GPU (prefill and decode share "
                                     f"GPU {p.gpu()}): use --kv-transport cuda_ipc (or auto), "
                                     "or give each daemon its own GPU")
    return mode


def ipc_fallback(p_mode: str, p: Endpoint, d_mode: str, d: Endpoint) -> str | None:
    """What ``auto`` uses when cuda_ipc was chosen but the producer cannot map the consumer's
    cache (its GPU is not visible here, e.g. another CUDA_VISIBLE_DEVICES): ``nccl`` between
    two GPUs; None (refuse) on one GPU or when cuda_ipc was asked for by name."""
    if "cuda_ipc" in (p_mode, d_mode) or same_gpu(p, d):
        return None
    return "nccl"


def listen(transport: str, host: str, connect_timeout_s: float):
    """The producer's rendezvous for a new pair (its ``port`` goes in HANDSHAKE_OK), waiting
    at most ``connect_timeout_s`` for the consumer; ``None`` for cuda_ipc, where nothing
    travels over a connection."""
    if transport == "tcp":
        from common.kv_transfer.tcp_pair import TcpListener

        return TcpListener(host, connect_timeout_s)
    if transport in ("gloo", "nccl"):
        from common.kv_transfer.p2p_group import host_store

        return host_store(host, connect_timeout_s)
    return None


def open_pair(transport: str, rank: int, timeout_s: float, pair_id: str, *, connect_timeout_s: float,
              rendezvous=None, host: str = "", port: int = 0, device: str = "cpu", peer_cache=None,
              streams: StreamOps | None = None, key: ClusterKey | None = None):
    """Build this side's pair (blocks until the peer is there: call it off the serving thread).

    Building it may take ``connect_timeout_s`` (NCCL's first communicator takes seconds);
    each operation on it then ``timeout_s``. ``rendezvous`` is what :func:`listen` returned
    (rank 0); rank 1 joins ``host:port``. ``peer_cache`` (cuda_ipc, rank 0) is the
    consumer's exported KV cache; ``streams`` orders GPU work (default: by ``device``); ``key``
    (the cluster key) is what both ranks prove at connect (pair_auth.py)."""
    if transport == "tcp":
        from common.kv_transfer.tcp_pair import TcpPair

        return TcpPair(rank, timeout_s, pair_id, listener=rendezvous, host=host, port=port,
                       connect_timeout_s=connect_timeout_s, key=key)
    if transport in ("gloo", "nccl"):
        from common.kv_transfer.pair_auth import store_prefix
        from common.kv_transfer.p2p_group import PairGroup

        if rendezvous is not None:
            host, port = rendezvous.host, rendezvous.port
        return PairGroup(transport, rank, host, port, timeout_s, store=rendezvous, device=device,
                         connect_timeout_s=connect_timeout_s, prefix=store_prefix(key, pair_id))
    if transport == "cuda_ipc":
        from common.kv_transfer.cuda_ipc import IpcPair

        return IpcPair(rank, device, peer_cache, timeout_s, streams or stream_ops(device))
    raise ValueError(f"unknown transport {transport!r}")
