"""Registration with the proxy: the heartbeat message and the daemon-side sender.

Each daemon's DEALER socket sends a msgpack map to the proxy's ROUTER every few
seconds. The first three keys are vLLM's xPyD format, so a vLLM node can register
with our proxy (and our node with a vLLM proxy)::

    {"type": "P"|"D", "http_address": "host:port", "zmq_address": "host:port"}

Our daemons add what a router needs: model, KV layout fingerprint, load, version,
and ``goodbye: true`` on a graceful stop. Our registry answers a decode node's heartbeat
with ``{"members": [prefill KV addresses]}`` (:attr:`Heartbeater.members`): the prefill
nodes it may pull KV from; a prefill node's with its decode nodes' KV addresses (one per KV
rank): the consumers whose pairs keep their slots (keyless, common/kv_transfer/producer.py).
Every field is bounded: the registry is reachable by anyone who can reach its port, so a
message is checked by one model (:class:`RegistrationMessage`) before anything reads it. With a cluster key the map
travels with a seal (see common.cluster_auth); without one the wire is vLLM's.
"""

from __future__ import annotations

import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, fields
from typing import TYPE_CHECKING, Annotated, Literal

import msgpack
import pydantic
import zmq
from pydantic import Field, TypeAdapter
from pydantic.dataclasses import dataclass

from common.cluster_auth import ClusterKey, registry_sealer
from common.defaults import MAX_HEARTBEAT_INTERVAL_S
from common.engine.protocol import EngineStats
from common.kv_topology import MAX_KV_HEADS, MAX_TP_SIZE

if TYPE_CHECKING:  # the proxy reads heartbeats without importing torch
    from common.kv_layout import KVLayout

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
NODE_TYPES = ("P", "D")
MAX_MESSAGE_BYTES = 8192  # a real heartbeat is ~300 bytes; every field at its limit fits
_HOST_PORT = re.compile(r"^[A-Za-z0-9._\-\[\]:%]{1,253}:(\d{1,5})$")
_COUNT = Annotated[int, Field(strict=True, ge=0, le=2**31)]
_NAME = Annotated[str, Field(strict=True, min_length=1, max_length=1024)]  # model names may be paths
_INTERVAL = Annotated[float, Field(strict=True, gt=0, le=MAX_HEARTBEAT_INTERVAL_S)]
_SECONDS = Annotated[float, Field(strict=True, ge=0, le=1e9)]
_RATE = Annotated[float, Field(strict=True, gt=0, le=1e12)]


def adaptive_figures(stats: EngineStats) -> dict:
    """The heartbeat keys of a node's measured prefill figures (unset ones left out)."""
    figures = {"prefill_tokens_per_s": stats.prefill_tokens_per_s and round(stats.prefill_tokens_per_s, 1),
               "pending_prefill_tokens": stats.pending_prefill_tokens, "num_decoding": stats.num_decoding,
               "max_local_prefill_stall_ms": stats.max_local_prefill_stall_ms}
    rates = {medium: round(min(stats.kv_tiers[tier]["load_bytes_per_s"], 1e11), 1)
             for tier, medium in (("host", "CPU"), ("disk", "DISK"), ("peer", "PEER"))
             if stats.kv_tiers and stats.kv_tiers.get(tier, {}).get("load_bytes_per_s")}
    if rates:
        figures["kv_tier_load_bytes_per_s"] = rates
    return {k: v for k, v in figures.items() if v is not None}


def transfer_figures(layout: KVLayout, recv_bytes_per_s: float | None) -> dict:
    """The heartbeat keys of what a prompt's KV costs to move: its bytes per token (the KV
    layout's) and, from a decode node that has received some, the measured P->D rate."""
    figures = {"kv_bytes_per_token": float(layout.bytes_per_block_per_layer() * layout.num_layers
                                           / layout.block_size)}
    if recv_bytes_per_s:
        figures["kv_transfer_bytes_per_s"] = float(round(recv_bytes_per_s, 1))
    return figures


class RegistrationError(ValueError):
    """A registration message that cannot be understood."""


def check_host_port(value: str) -> str:
    m = _HOST_PORT.match(value)
    if m is None or not 1 <= int(m.group(1)) <= 65535:
        raise ValueError("must be HOST:PORT with a port in 1..65535")
    return value


_ADDRESS = Annotated[str, Field(strict=True, max_length=262), pydantic.AfterValidator(check_host_port)]


@dataclass(frozen=True)
class KVEventsInfo:
    """Where a node publishes its KV events (common/kv_events.py) and how far it got: the PUB and
    replay addresses, the publisher's random ``epoch`` (a new one: a restarted node, a new cache),
    the last batch's sequence number (-1: none yet) and the engine's hash chain ``root`` (hex), from
    which the proxy names a prompt's blocks as the node does."""

    endpoint: _ADDRESS
    replay: _ADDRESS
    epoch: Annotated[str, Field(strict=True, pattern=r"^[0-9a-f]{8,32}$")]
    seq: Annotated[int, Field(strict=True, ge=-1, le=2**62)]
    root: Annotated[str, Field(strict=True, pattern=r"^[0-9a-f]{32}$")]


@dataclass(frozen=True)
class RegistrationMessage:
    """One heartbeat. ``zmq_address`` is the node's KV (transfer control) endpoint."""

    type: Literal["P", "D"]  # "P" (prefill) or "D" (decode)
    http_address: _ADDRESS  # "host:port" of the node's OpenAI HTTP server
    zmq_address: _ADDRESS  # "host:port" of the node's KV transfer ROUTER
    model: _NAME | None = None  # served model name; None for vLLM-format nodes
    kv_fingerprint: _NAME | None = None  # KVLayout.fingerprint(): the whole model's layout, whatever its TP
    tp_size: Annotated[int, Field(strict=True, ge=1, le=MAX_TP_SIZE)] | None = None  # --tensor-parallel-size
    kv_heads: Annotated[int, Field(strict=True, ge=1, le=MAX_KV_HEADS)] | None = None  # the model's, all ranks
    # a prefill node's KV ranks, when not one per rank (--kv-ranks: each rank's heads in slices)
    kv_ranks: Annotated[int, Field(strict=True, ge=1, le=MAX_TP_SIZE)] | None = None
    block_size: Annotated[int, Field(strict=True, ge=1, le=1 << 16)] | None = None  # named when nodes do not pair
    version: _COUNT | None = None  # PROTOCOL_VERSION of the sender
    node_id: _NAME | None = None
    num_running: _COUNT = 0
    num_waiting: _COUNT = 0
    num_free_blocks: _COUNT | None = None
    num_total_blocks: _COUNT | None = None
    heartbeat_interval_s: _INTERVAL | None = None
    engine_stalled_s: _SECONDS | None = None  # time in the engine's current iteration; 0 when idle
    # adaptive disaggregation (proxy/disagg.py): what the node measures of its own prefill
    prefill_tokens_per_s: _RATE | None = None  # EWMA of timed prefill steps
    pending_prefill_tokens: _COUNT | None = None  # prompt tokens queued, not yet computed
    num_decoding: _COUNT | None = None  # running sequences past their prompt
    max_local_prefill_stall_ms: _RATE | None = None  # decode: its bound on a decode step's wait for a prefill
    kv_bytes_per_token: _RATE | None = None  # a prompt token's KV, all layers (the KV layout's)
    kv_transfer_bytes_per_s: _RATE | None = None  # decode: measured P->D rate, first byte to DONE (EWMA)
    # KV tiers (common/engine/kv_tiers.py): each tier's measured load rate, by its KV events' medium, and
    # "PEER": the rate of prefix blocks fetched from other nodes (--kv-peer-fetch, first ask to landed)
    kv_tier_load_bytes_per_s: dict[Literal["CPU", "DISK", "PEER"], _RATE] | None = None
    # --kv-peer-fetch on: the node serves its cached prefix blocks to peers on its KV endpoint
    # (``zmq_address``) and fetches from them; the registry names its peers, the proxy hints a holder
    kv_peer_fetch: Annotated[bool, Field(strict=True)] | None = None
    goodbye: Annotated[bool, Field(strict=True)] | None = None  # True: stopping; stop routing here now
    kv_events: KVEventsInfo | None = None  # its prefix cache's events, for exact prefix routing
    # a role flip (common/node/role_flip.py): the role's epoch, +1 per flip (None: 0, never flipped),
    # and whether the node serves its role now; draining or fenced, nothing is routed to it
    role_epoch: Annotated[int, Field(strict=True, ge=0, le=2**62)] | None = None
    role_state: Literal["serving", "draining", "fenced"] | None = None

    @property
    def routable(self) -> bool:
        """May the router send it requests of its role (not draining for a flip, not fenced)?"""
        return self.role_state in (None, "serving")

    @property
    def load(self) -> int:
        """Requests the node holds (running + waiting), as of this heartbeat."""
        return self.num_running + self.num_waiting

    def to_dict(self) -> dict:
        """The wire map, without unset optional keys (so vLLM-format stays minimal)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: object) -> RegistrationMessage:
        """Validate a decoded map; unknown keys are ignored (newer senders)."""
        if not isinstance(data, dict):
            raise RegistrationError(f"registration must be a map, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        try:
            return _ADAPTER.validate_python({k: v for k, v in data.items() if k in known})
        except pydantic.ValidationError as exc:
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"]) or "message"
            raise RegistrationError(f"{where}: {err['msg'][:200]}") from None


_ADAPTER = TypeAdapter(RegistrationMessage)


def encode(msg: RegistrationMessage) -> bytes:
    """The msgpack bytes sent on the wire."""
    return msgpack.packb(msg.to_dict(), use_bin_type=True)


def decode(frame: bytes) -> RegistrationMessage:
    """Parse one frame; raises RegistrationError on anything malformed or oversized."""
    if len(frame) > MAX_MESSAGE_BYTES:
        raise RegistrationError(f"message of {len(frame)} bytes (at most {MAX_MESSAGE_BYTES})")
    try:
        data = msgpack.unpackb(frame, raw=False)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
        raise RegistrationError(f"not a msgpack map: {type(exc).__name__}") from None
    return RegistrationMessage.from_dict(data)


MAX_MEMBERS = 4096
RETRY_S = 0.1  # a heartbeat that could not be handed to a live connection is tried again this soon
GOODBYE_WAIT_MS = 1000  # how long a graceful stop waits to hand its goodbye to the connection


def encode_members(kv_addresses: list[str], tp_sizes: dict[str, int] | None = None,
                   peers: list[str] | None = None) -> bytes:
    """The registry's answer to a node's heartbeat: the other type's nodes it pairs with, the
    tensor-parallel size of those with more than one rank (``tp_ranks``'s routes need it), and the
    peers it may fetch prefix blocks from (``--kv-peer-fetch``; empty for a node without it)."""
    return msgpack.packb({"members": kv_addresses, "tp_sizes": tp_sizes or {}, "peers": (peers or [])[:MAX_MEMBERS]},
                         use_bin_type=True)


def decode_member_tp_sizes(frame: bytes, members: frozenset[str]) -> dict[str, int]:
    """The ``tp_sizes`` of :func:`encode_members`'s bytes, for addresses in ``members`` (a
    registry from before it, or an entry out of bounds, says nothing: one rank is assumed)."""
    try:
        sizes = msgpack.unpackb(frame, raw=False).get("tp_sizes") or {}
    except Exception:  # noqa: BLE001 - decode_members already vouched for the frame
        return {}
    if not isinstance(sizes, dict):
        return {}
    return {a: n for a, n in sizes.items() if a in members and isinstance(n, int) and not isinstance(n, bool)
            and 1 <= n <= MAX_TP_SIZE}


def decode_members(frame: bytes) -> frozenset[str]:
    """Parse :func:`encode_members`'s bytes; raises RegistrationError on anything else."""
    return _addresses(frame, "members", required=True)


def decode_peers(frame: bytes) -> frozenset[str]:
    """The ``peers`` of :func:`encode_members`'s bytes, checked as ``members`` are (an answer
    without them, from a registry before them, names none); raises RegistrationError on a bad list."""
    return _addresses(frame, "peers", required=False)


def _addresses(frame: bytes, name: str, required: bool) -> frozenset[str]:
    try:
        data = msgpack.unpackb(frame, raw=False)
        addresses = data[name] if required else data.get(name, [])
        if not isinstance(addresses, list) or len(addresses) > MAX_MEMBERS:
            raise TypeError(f"{name} is not a bounded list")
        return frozenset(check_host_port(a) for a in addresses if isinstance(a, str) and len(a) <= 262)
    except Exception as exc:  # noqa: BLE001 - msgpack and the checks raise several types
        raise RegistrationError(f"not a {name} list: {type(exc).__name__}") from None


def zmq_endpoint(address: str) -> str:
    """``host:port`` -> ``tcp://host:port`` (full endpoints pass through)."""
    return address if "://" in address else f"tcp://{address}"


class Heartbeater:
    """Sends ``info()`` to the proxy every ``interval_s`` from a daemon thread.

    ``info`` returns the message fields as a dict (see RegistrationMessage); it is
    called for every beat so the load figures are fresh. The first beat goes out
    at once. The proxy may be down or restart: ZMQ reconnects by itself, and beats
    that cannot be delivered are dropped rather than queued (stale load is useless);
    after a dropped beat the next is tried ``RETRY_S`` later, so a node registers as soon
    as its connection is up, not one interval after.

        def info() -> dict:
            s = engine.stats()
            return {"type": "P", "http_address": "10.0.0.5:8100", "zmq_address": "10.0.0.5:14579",
                    "model": "tiny", "kv_fingerprint": layout.fingerprint(), "node_id": "p-0",
                    "num_running": s.num_running, "num_waiting": s.num_waiting,
                    "num_free_blocks": s.num_free_blocks, "num_total_blocks": s.num_total_blocks}

        beat = Heartbeater("10.0.0.1:30001", info); beat.start(); ...; beat.stop()
    """

    def __init__(self, proxy_address: str, info: Callable[[], dict], interval_s: float = 2.0,
                 key: ClusterKey | None = None):
        self.proxy_address = proxy_address
        self.interval_s = interval_s
        self._info = info
        self._sealer = registry_sealer(key)
        self._stop = threading.Event()
        self._now = threading.Event()  # nudge(): beat now, not at the next interval
        self._wake_w: socket.socket | None = None  # ends the heartbeat thread's wait (nudge)
        self._thread: threading.Thread | None = None
        self.beats_sent = 0
        # the prefill KV addresses the registry last named (decode nodes); None: no answer yet,
        # or a registry that does not answer (vLLM's)
        self.members: frozenset[str] | None = None
        self.member_tp_sizes: dict[str, int] = {}  # of those members, the ones with more than one rank
        # the KV addresses of the peers the registry last named (--kv-peer-fetch): whom this node may
        # fetch cached prefix blocks from; empty until an answer names some
        self.peers: frozenset[str] = frozenset()
        self.answered_at: float | None = None  # time.monotonic() of the registry's last answer

    def start(self) -> None:
        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="pdserve-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=max(2.0, self.interval_s))
            self._thread = None

    def nudge(self) -> None:
        """Send a beat now (the node's role or state changed: the proxy must know at once)."""
        self._now.set()
        wake = self._wake_w
        if wake is not None:
            try:
                wake.send(b"\0")
            except OSError:  # full (a byte is already there) or closed (stopping): either is enough
                pass

    def _message(self, goodbye: bool = False) -> list[bytes]:
        data = dict(self._info())
        data.setdefault("version", PROTOCOL_VERSION)
        data.setdefault("heartbeat_interval_s", self.interval_s)
        if goodbye:
            data["goodbye"] = True
        return self._sealer.frames(encode(RegistrationMessage.from_dict(data)))

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Queue only on live connections, and at most one beat: a beat held while the
        # proxy is down would arrive later carrying stale load.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        # a proxy that comes back is reconnected to within half a heartbeat (at most 1 s): it hears
        # from this node within one heartbeat of listening again
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, max(100, min(1000, int(self.interval_s * 500))))
        sock.setsockopt(zmq.IPV6, int(self.proxy_address.startswith("[")))
        sock.connect(zmq_endpoint(self.proxy_address))
        wake_r, self._wake_w = socket.socketpair()  # nudge() writes a byte: the wait below ends at once
        wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(wake_r.fileno(), zmq.POLLIN)
        linger = 0
        try:
            while not self._stop.is_set():
                # a beat dropped (no live connection yet: the first one, sent before the connect
                # completed, or the proxy just restarted) is tried again soon, not an interval later
                dropped = self._beat(sock) == "dropped"
                deadline = time.monotonic() + (min(self.interval_s, RETRY_S) if dropped else self.interval_s)
                while not (self._stop.is_set() or self._now.is_set()) and (left := deadline - time.monotonic()) > 0:
                    ready = dict(poller.poll(max(1, int(min(left, 0.2) * 1000))))
                    if sock in ready:  # the registry's answer
                        self._read_members(sock)
                    if wake_r.fileno() in ready:
                        wake_r.recv(64)
                self._now.clear()
            # a graceful stop says goodbye, so the proxy stops routing here now, not at eviction
            linger = 500 if self._beat(sock, goodbye=True) == "sent" else 0
        finally:
            sock.close(linger=linger)
            ctx.term()
            self._wake_w, wake_w = None, self._wake_w
            wake_r.close()
            wake_w.close()

    def _read_members(self, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            payload, _ = self._sealer.open(frames)
            try:
                if payload is not None and len(payload) <= 64 * MAX_MESSAGE_BYTES:
                    members, peers = decode_members(payload), decode_peers(payload)
                    self.member_tp_sizes = decode_member_tp_sizes(payload, members)
                    if members != self.members:
                        logger.info("the registry at %s names %d peer KV address(es): %s", self.proxy_address,
                                    len(members), _listed(members))
                    if peers != self.peers:
                        logger.info("the registry at %s names %d prefix peer(s) (--kv-peer-fetch): %s",
                                    self.proxy_address, len(peers), _listed(peers))
                    self.members, self.peers = members, peers
                    self.answered_at = time.monotonic()
            except RegistrationError as exc:
                logger.warning("registry answer ignored: %s", exc)

    def _beat(self, sock: zmq.Socket, goodbye: bool = False) -> str:
        """One beat: "sent", "dropped" (no live connection to hand it to) or "failed" (``info`` raised)."""
        try:
            frames = self._message(goodbye)
        except Exception as exc:  # noqa: BLE001 - a daemon callback must not kill the heartbeat thread
            logger.error("heartbeat info failed, beat not sent: %s", exc)
            return "failed"
        try:
            # the goodbye waits (briefly) for room behind a beat still in the one-message queue:
            # dropped, the node would stay routable until the proxy evicts it
            if goodbye:
                sock.poll(GOODBYE_WAIT_MS, zmq.POLLOUT)
            sock.send_multipart(frames, zmq.NOBLOCK)
            self.beats_sent += 1
            return "sent"
        except zmq.Again:
            logger.debug("proxy %s not reachable, heartbeat dropped", self.proxy_address)
            return "dropped"


def _listed(addresses: frozenset[str]) -> str:
    """A log line's list of addresses: the first 16, sorted."""
    return ", ".join(sorted(addresses)[:16]) + (" ..." if len(addresses) > 16 else "")
