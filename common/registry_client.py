"""Registration with the proxy: the heartbeat message and the daemon-side sender.

Each daemon's DEALER socket sends a msgpack map to the proxy's ROUTER every few
seconds. The first three keys are vLLM's xPyD format, so a vLLM node can register
with our proxy (and our node with a vLLM proxy)::

    {"type": "P"|"D", "http_address": "host:port", "zmq_address": "host:port"}

Our daemons add what a router needs: model, KV layout fingerprint, load, version.
A message without them still registers; such nodes pair only with each other.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields

import msgpack
import zmq

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
NODE_TYPES = ("P", "D")


class RegistrationError(ValueError):
    """A registration message that cannot be understood."""


@dataclass(frozen=True)
class RegistrationMessage:
    """One heartbeat. ``zmq_address`` is the node's KV (transfer control) endpoint."""

    type: str  # "P" (prefill) or "D" (decode)
    http_address: str  # "host:port" of the node's OpenAI HTTP server
    zmq_address: str  # "host:port" of the node's KV transfer ROUTER
    model: str | None = None  # served model name; None for vLLM-format nodes
    kv_fingerprint: str | None = None  # KVLayout.fingerprint()
    version: int | None = None  # PROTOCOL_VERSION of the sender
    node_id: str | None = None
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int | None = None
    num_total_blocks: int | None = None
    heartbeat_interval_s: float | None = None

    @property
    def load(self) -> int:
        """Requests the node holds (running + waiting), as of this heartbeat."""
        return self.num_running + self.num_waiting

    def to_dict(self) -> dict:
        """The wire map, without unset optional keys (so vLLM-format stays minimal)."""
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict) -> RegistrationMessage:
        """Validate a decoded map; unknown keys are ignored (newer senders)."""
        if not isinstance(data, dict):
            raise RegistrationError(f"registration must be a map, got {type(data).__name__}")
        data = {k.decode() if isinstance(k, bytes) else k: v for k, v in data.items()}
        for key in ("type", "http_address", "zmq_address"):
            if not isinstance(data.get(key), str) or not data[key]:
                raise RegistrationError(f"registration needs a non-empty string {key!r}")
        if data["type"] not in NODE_TYPES:
            raise RegistrationError(f"registration type must be 'P' or 'D', got {data['type']!r}")
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise RegistrationError(str(exc)) from exc


def encode(msg: RegistrationMessage) -> bytes:
    """The msgpack bytes sent on the wire."""
    return msgpack.packb(msg.to_dict(), use_bin_type=True)


def decode(frame: bytes) -> RegistrationMessage:
    """Parse one frame; raises RegistrationError on anything malformed."""
    try:
        data = msgpack.unpackb(frame, raw=False)
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError, ValueError) as exc:
        raise RegistrationError(f"not a msgpack map: {exc}") from exc
    return RegistrationMessage.from_dict(data)


def zmq_endpoint(address: str) -> str:
    """``host:port`` -> ``tcp://host:port`` (full endpoints pass through)."""
    return address if "://" in address else f"tcp://{address}"


class Heartbeater:
    """Sends ``info()`` to the proxy every ``interval_s`` from a daemon thread.

    ``info`` returns the message fields as a dict (see RegistrationMessage); it is
    called for every beat so the load figures are fresh. The first beat goes out
    at once. The proxy may be down or restart: ZMQ reconnects by itself, and beats
    that cannot be delivered are dropped rather than queued (stale load is useless).

        def info() -> dict:
            s = engine.stats()
            return {"type": "P", "http_address": "10.0.0.5:8100", "zmq_address": "10.0.0.5:14579",
                    "model": "tiny", "kv_fingerprint": layout.fingerprint(), "node_id": "p-0",
                    "num_running": s.num_running, "num_waiting": s.num_waiting,
                    "num_free_blocks": s.num_free_blocks, "num_total_blocks": s.num_total_blocks}

        beat = Heartbeater("10.0.0.1:30001", info); beat.start(); ...; beat.stop()
    """

    def __init__(self, proxy_address: str, info: Callable[[], dict], interval_s: float = 2.0):
        self.proxy_address = proxy_address
        self.interval_s = interval_s
        self._info = info
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.beats_sent = 0

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

    def _message(self) -> bytes:
        data = dict(self._info())
        data.setdefault("version", PROTOCOL_VERSION)
        data.setdefault("heartbeat_interval_s", self.interval_s)
        return encode(RegistrationMessage.from_dict(data))

    def _run(self) -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        # Queue only on live connections, and at most one beat: a beat held while the
        # proxy is down would arrive later carrying stale load.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.setsockopt(zmq.SNDHWM, 1)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.connect(zmq_endpoint(self.proxy_address))
        try:
            while not self._stop.is_set():
                self._beat(sock)
                self._stop.wait(self.interval_s)
        finally:
            sock.close(linger=0)
            ctx.term()

    def _beat(self, sock: zmq.Socket) -> None:
        try:
            frame = self._message()
        except Exception as exc:  # noqa: BLE001 - a daemon callback must not kill the heartbeat thread
            logger.error("heartbeat info failed, beat not sent: %s", exc)
            return
        try:
            sock.send(frame, zmq.NOBLOCK)
            self.beats_sent += 1
        except zmq.Again:
            logger.debug("proxy %s not reachable, heartbeat dropped", self.proxy_address)
