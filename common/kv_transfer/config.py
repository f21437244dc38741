"""Configuration, counters and errors of the KV transfer layer."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field


class TransferError(RuntimeError):
    """A transfer failed: dead or unreachable peer, timeout, refused handshake."""


class PairBrokenError(TransferError):
    """The data-plane pair failed (timeout, closed connection); it must be rebuilt."""


class ConnectionReopened(TransferError):
    """A control request lost with a connection the control plane closed and reopened (another
    request on it went unanswered: a silent peer, typically a network partition). Nothing says
    the peer saw it; sending it again goes on the fresh connection."""


class NoPairError(TransferError):
    """No pair could be had with the producer: it refused the handshake (``reason`` "pairs_full"
    at its --kv-max-pairs, else "pair_refused"). Nothing was asked for or landed, so the decode
    node computes the prompt itself (:func:`no_pair_reason` finds the reason in the failure's text,
    which is what crosses tensor-parallel ranks)."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"no KV pair ({reason}): {message}")
        self.reason = reason


def no_pair_reason(error: str) -> str | None:
    """The reason of a :class:`NoPairError` whose text ``error`` holds (a prefix may name a rank), else None."""
    start = error.find("no KV pair (")
    if start < 0:
        return None
    reason = error[start + len("no KV pair ("):].partition(")")[0]
    return reason if reason.replace("_", "").isalpha() else None


@dataclass(frozen=True)
class TransferConfig:
    """Knobs of one process's KV endpoint. Times are seconds."""

    timeout_s: float = 5.0  # one data-plane operation or one control request/response
    lease_s: float = 30.0  # how long the producer holds a request's KV waiting for the consumer
    handshake_timeout_s: float = 10.0  # the control handshake (an unreachable producer fails this fast)
    connect_timeout_s: float = 60.0  # building a data-plane pair after it (NCCL's first set-up takes long)
    max_bytes_in_flight: int = 256 << 20  # staged (gathered, not yet sent) bytes on the producer
    heartbeat_s: float = 1.0  # consumer pings a producer it waits on this often
    coalesce_bytes: int = 16 << 20  # layers gathered after prefill travel in messages up to this size
    peer_idle_s: float = 60.0  # a peer connection (and its receiver thread) unused this long is closed
    max_peers: int = 256  # control-plane connections to distinct peers, at most
    max_pairs: int = 64  # data-plane pairs a producer holds (a thread and sockets each), at most
    pair_idle_s: float = 60.0  # a producer closes a pair that carried no transfer this long
    # keyless: a pair whose consumer names no registered decode node gets this long to become one;
    # after it, or as soon as a member needs its slot, it is dropped
    probation_s: float = 5.0
    checksum: str = "auto"  # per-layer CRC-32 of the KV: auto (off today), on, off (verify.py)

    def __post_init__(self) -> None:
        for name in ("timeout_s", "lease_s", "handshake_timeout_s", "connect_timeout_s", "heartbeat_s",
                     "peer_idle_s", "pair_idle_s", "probation_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TransferConfig.{name} must be > 0, got {getattr(self, name)}")
        if self.checksum not in ("auto", "on", "off"):
            raise ValueError(f"TransferConfig.checksum must be auto, on or off, got {self.checksum!r}")
        if self.max_pairs < 1:
            raise ValueError("TransferConfig.max_pairs must be >= 1")
        if self.max_bytes_in_flight <= 0:
            raise ValueError("TransferConfig.max_bytes_in_flight must be > 0")

    @property
    def peer_silent_s(self) -> float:
        """A consumer that holds a pair pings it every ``heartbeat_s``; one silent this long
        is gone, and the producer drops its cuda_ipc pair (and the mapping of its cache)."""
        return self.timeout_s + 3 * self.heartbeat_s


RATE_EWMA_WEIGHT = 0.2  # of the newest transfer in TransferStats' rate


@dataclass
class TransferStats:
    """Counters the daemons export as metrics (base units). Thread-safe increments.

    ``on_transfer`` (optional) is called with (seconds, bytes) for every finished transfer,
    from a background thread: a daemon can feed a Prometheus histogram from it.
    """

    bytes_sent: int = 0
    bytes_received: int = 0
    transfers_sent: int = 0
    transfers_received: int = 0
    transfer_seconds_sum: float = 0.0
    failures: int = 0
    leases_expired: int = 0
    on_transfer: Callable[[float, int], None] | None = None
    # consumer: bytes and seconds from a transfer's first byte to its DONE (EWMAs; their ratio is
    # the P->D rate the proxy's adaptive disaggregation weighs, see ``recv_bytes_per_s``)
    _rate_bytes: float = 0.0
    _rate_seconds: float = 0.0
    rejected: dict[str, int] = field(default_factory=dict)  # landed KV refused, by reason (verify.py)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, **deltas: float) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self, name, getattr(self, name) + delta)

    def reject(self, reason: str) -> None:
        with self._lock:
            self.rejected[reason] = self.rejected.get(reason, 0) + 1

    def rejected_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.rejected)

    def transfer_done(self, seconds: float, nbytes: int) -> None:
        self.add(transfers_received=1, transfer_seconds_sum=seconds)
        if self.on_transfer is not None:
            self.on_transfer(seconds, nbytes)

    def transfer_rate(self, nbytes: int, seconds: float) -> None:
        """A received transfer's bytes over its first-byte-to-DONE time (not from the PULL: that
        would count the producer's queue and prefill as transfer time)."""
        if nbytes <= 0 or seconds <= 0:
            return
        with self._lock:
            first = self._rate_seconds == 0.0
            self._rate_bytes += nbytes if first else RATE_EWMA_WEIGHT * (nbytes - self._rate_bytes)
            self._rate_seconds += seconds if first else RATE_EWMA_WEIGHT * (seconds - self._rate_seconds)

    @property
    def recv_bytes_per_s(self) -> float | None:
        """The measured P->D rate (bytes/s; larger transfers weigh more); None before the first."""
        with self._lock:
            return self._rate_bytes / self._rate_seconds if self._rate_seconds > 0 else None

    def transfer_sent(self, seconds: float) -> None:
        """The consumer acknowledged a pushed request. Its bytes were counted as they were
        sent (``bytes_sent``), so ``on_transfer`` gets 0 bytes here: only the duration."""
        self.add(transfers_sent=1, transfer_seconds_sum=seconds)
        if self.on_transfer is not None:
            self.on_transfer(seconds, 0)

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            return {
                k: getattr(self, k)
                for k in ("bytes_sent", "bytes_received", "transfers_sent", "transfers_received",
                          "transfer_seconds_sum", "failures", "leases_expired")
            }
