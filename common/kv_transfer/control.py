"""The control plane: one ZMQ ROUTER per endpoint, one DEALER per remote endpoint.

One thread owns every socket (ZMQ sockets are not thread-safe); other threads hand it
work through a queue and a wake-up socketpair, so nothing they call blocks on the network.
Requests get a response matched by message id or fail at their deadline. Frames that do
not decode are logged and dropped; the listener keeps serving.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import zmq

from common.kv_transfer.config import TransferError
from common.kv_transfer.messages import Message, MessageError, decode, encode

logger = logging.getLogger(__name__)

RouterHandler = Callable[[bytes, Message], None]  # (consumer identity, message)
DealerHandler = Callable[[str, Message], None]  # (producer address, unsolicited message)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host, int(port)


class ControlPlane:
    """Binds a ROUTER at ``address`` (port 0 picks a free one) and runs the socket thread."""

    def __init__(self, address: str, on_router: RouterHandler, on_dealer: DealerHandler) -> None:
        host, port = split_address(address)
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a gone peer raises, not vanishes
        if port == 0:
            port = self._router.bind_to_random_port(f"tcp://{host}")
        else:
            self._router.bind(f"tcp://{host}:{port}")
        self.address = f"{host}:{port}"
        self._on_router, self._on_dealer = on_router, on_dealer
        self._dealers: dict[str, zmq.Socket] = {}
        self._outbox: queue.SimpleQueue[tuple[str, object, Message]] = queue.SimpleQueue()
        self._pending: dict[int, tuple[Future, float]] = {}
        self._pending_lock = threading.Lock()
        self._next_id = 1
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kv-control-{port}", daemon=True)
        self._thread.start()

    # ---- API for other threads -------------------------------------------------------
    def send(self, peer_address: str, msg: Message) -> None:
        """Fire-and-forget to a remote endpoint's ROUTER."""
        self._post("dealer", peer_address, msg)

    def reply(self, identity: bytes, msg: Message) -> None:
        """Send to a consumer that reached our ROUTER."""
        self._post("router", identity, msg)

    def request(self, peer_address: str, msg: Message, timeout_s: float) -> Future:
        """Send and return a Future for the response; it fails with TransferError at the deadline."""
        fut: Future = Future()
        with self._pending_lock:
            msg.id = self._next_id
            self._next_id += 1
            self._pending[msg.id] = (fut, time.monotonic() + timeout_s)
        self._post("dealer", peer_address, msg)
        return fut

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        with self._pending_lock:
            for fut, _ in self._pending.values():
                fut.set_exception(TransferError("control plane closed"))
            self._pending.clear()
        for sock in (self._router, *self._dealers.values()):
            sock.close(linger=0)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    # ---- socket thread ---------------------------------------------------------------
    def _post(self, kind: str, target: object, msg: Message) -> None:
        self._outbox.put((kind, target, msg))
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already pending wake-up, or closing

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(50))
            if self._wake_r.fileno() in events:
                self._drain_wake()
            self._flush_outbox(poller)
            if self._router in events:
                self._read_router()
            for address, sock in list(self._dealers.items()):
                if sock in events:
                    self._read_dealer(address, sock)
            self._expire_pending()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except BlockingIOError:
            pass

    def _flush_outbox(self, poller: zmq.Poller) -> None:
        while True:
            try:
                kind, target, msg = self._outbox.get_nowait()
            except queue.Empty:
                return
            try:
                if kind == "router":
                    self._router.send_multipart([target, encode(msg)], flags=zmq.NOBLOCK)
                else:
                    self._dealer(target, poller).send(encode(msg), flags=zmq.NOBLOCK)
            except zmq.ZMQError as e:
                logger.warning("control: cannot send %s to %r: %s", msg.CMD, target, e)
                self._fail_pending(msg.id, TransferError(f"peer {target!r} unreachable: {e}"))

    def _dealer(self, address: str, poller: zmq.Poller) -> zmq.Socket:
        sock = self._dealers.get(address)
        if sock is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{address}")  # reconnects by itself when the peer restarts
            poller.register(sock, zmq.POLLIN)
            self._dealers[address] = sock
        return sock

    def _read_router(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:
                logger.warning("control: dropped a %d-frame message", len(frames))
                continue
            msg = self._decode(frames[1])
            if msg is not None:
                self._dispatch(self._on_router, frames[0], msg)

    def _read_dealer(self, address: str, sock: zmq.Socket) -> None:
        while True:
            try:
                frame = sock.recv(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            msg = self._decode(frame)
            if msg is None:
                continue
            with self._pending_lock:
                entry = self._pending.pop(msg.id, None) if msg.id else None
            if entry is not None:
                entry[0].set_result(msg)
            else:
                self._dispatch(self._on_dealer, address, msg)

    @staticmethod
    def _decode(frame: bytes) -> Message | None:
        try:
            return decode(frame)
        except MessageError as e:
            logger.warning("control: dropped a malformed message: %s", e)
            return None

    @staticmethod
    def _dispatch(handler: Callable, origin: object, msg: Message) -> None:
        try:
            handler(origin, msg)
        except Exception:  # a handler bug must not kill the listener
            logger.exception("control: handler failed on %s", msg.CMD)

    def _fail_pending(self, msg_id: int, error: Exception) -> None:
        with self._pending_lock:
            entry = self._pending.pop(msg_id, None)
        if entry is not None:
            entry[0].set_exception(error)

    def _expire_pending(self) -> None:
        now = time.monotonic()
        with self._pending_lock:
            expired = [i for i, (_, deadline) in self._pending.items() if deadline <= now]
            futures = [self._pending.pop(i)[0] for i in expired]
        for fut in futures:
            fut.set_exception(TransferError("no response from peer before the deadline"))
