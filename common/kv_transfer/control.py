"""The control plane: one ZMQ ROUTER per endpoint, one DEALER per remote endpoint.

One thread owns every socket (ZMQ sockets are not thread-safe): the endpoint's I/O thread.
Other threads hand it work through a queue and a wake-up socketpair, so nothing they call
blocks on the network. Besides the ZMQ sockets it watches the plain sockets a half
registers (:meth:`watch`: a consumer's tcp pairs) and runs the callables posted to it
(:meth:`call_soon`) and a half's periodic ``on_tick``, so a half's links live on this one
thread too.
The owner never posts a wake-up to itself (it flushes the queue before it polls again) and
the wake-up socket never blocks (one pending byte is enough), so a flood of requests whose
replies it queues cannot make it wait on the socket only it drains.
Requests get a response matched by message id or fail at their deadline. Frames that do
not decode are logged and dropped; the listener keeps serving.

With a cluster key every message travels sealed (``[payload, seal]``, see
common.cluster_auth) and an unsealed, stale, replayed or foreign one is dropped, so only
cluster members can ask this node for KV. DEALERs are bounded: at most ``max_peers``,
and one with nothing pending and no traffic for ``idle_s`` is closed (its FD and its
reconnect timer go with it), so addresses that never answer cost nothing for long.
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

from common.cluster_auth import ClusterKey, control_sealer
from common.kv_transfer.config import ConnectionReopened, TransferError
from common.kv_transfer.messages import Message, MessageError, decode, encode

logger = logging.getLogger(__name__)

POLL_S = 0.05  # the loop's longest sleep
HOUSEKEEPING_S = 0.005  # deadlines, idle connections and on_tick: at most this often, at least every POLL_S
RouterHandler = Callable[[bytes, Message], None]  # (consumer identity, message)
DealerHandler = Callable[[str, Message], None]  # (producer address, unsolicited message)


def split_address(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"expected host:port, got {address!r}")
    return host, int(port)


class ControlPlane:
    """Binds a ROUTER at ``address`` (port 0 picks a free one) and runs the socket thread."""

    def __init__(self, address: str, on_router: RouterHandler, on_dealer: DealerHandler, *,
                 key: ClusterKey | None = None, idle_s: float = 60.0, max_peers: int = 256) -> None:
        host, port = split_address(address)
        self._sealer = control_sealer(key)
        self.key = key  # the pairs' data planes prove it at connect too (pair_auth.py)
        self.idle_s, self.max_peers = idle_s, max_peers
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
        self._last_used: dict[str, float] = {}  # dealer address -> last send or receive
        self._next_idle_check = 0.0
        self._dropped_logged: dict[str, float] = {}
        self._outbox: queue.SimpleQueue[tuple[str, object, Message | None]] = queue.SimpleQueue()
        self._pending: dict[int, tuple[Future, float, str]] = {}
        self._pending_lock = threading.Lock()
        self._next_id = 1
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)  # full = a wake-up is pending already
        # plain fd -> (called when readable, called when writable); either may be None
        self._watched: dict[int, tuple[Callable[[], None] | None, Callable[[], None] | None]] = {}
        self.on_tick: Callable[[], None] = lambda: None  # called every HOUSEKEEPING_S to POLL_S
        self._next_housekeeping = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kv-control-{port}", daemon=True)
        self._thread.start()

    # ---- API for other threads -------------------------------------------------------
    def send(self, peer_address: str, msg: Message, connect: bool = True) -> None:
        """Fire-and-forget to a remote endpoint's ROUTER; ``connect=False`` drops it unless a
        connection to that endpoint is already open."""
        self._post("dealer" if connect else "dealer_if_open", peer_address, msg)

    def reply(self, identity: bytes, msg: Message) -> None:
        """Send to a consumer that reached our ROUTER."""
        self._post("router", identity, msg)

    def request(self, peer_address: str, msg: Message, timeout_s: float) -> Future:
        """Send and return a Future for the response; it fails with TransferError at the deadline."""
        fut: Future = Future()
        with self._pending_lock:
            msg.id = self._next_id
            self._next_id += 1
            self._pending[msg.id] = (fut, time.monotonic() + timeout_s, peer_address)
        self._post("dealer", peer_address, msg)
        return fut

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the I/O thread, after what was posted before it (from any thread)."""
        self._post("call", fn, None)

    def in_loop(self) -> bool:
        return threading.current_thread() is self._thread

    def run_and_wait(self, fn: Callable[[], None], timeout_s: float) -> bool:
        """Run ``fn`` on the I/O thread and wait until it ran (not from the I/O thread); False
        if ``timeout_s`` passed first."""
        ran = threading.Event()

        def run() -> None:
            try:
                fn()
            finally:
                ran.set()
        self.call_soon(run)
        return ran.wait(timeout_s)

    def watch(self, fd: int, on_readable: Callable[[], None] | None = None,
              on_writable: Callable[[], None] | None = None) -> None:
        """I/O thread only: call ``on_readable`` whenever ``fd`` has bytes (or its close) to read,
        ``on_writable`` whenever it has room to send; both None stops watching it (before it is closed)."""
        if on_readable is None and on_writable is None:
            if self._watched.pop(fd, None) is not None:
                self._poller.unregister(fd)
            return
        self._watched[fd] = (on_readable, on_writable)
        self._poller.register(fd, (zmq.POLLIN if on_readable else 0) | (zmq.POLLOUT if on_writable else 0))

    def unwatch(self, fd: int) -> None:
        """I/O thread only: before ``fd`` is closed."""
        self.watch(fd)

    def close(self) -> None:
        self._stop.set()
        self._wake()
        self._thread.join(timeout=5)
        with self._pending_lock:
            for fut, _, _ in self._pending.values():
                fut.set_exception(TransferError("control plane closed"))
            self._pending.clear()
        for sock in (self._router, *self._dealers.values()):
            sock.close(linger=0)
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    # ---- socket thread ---------------------------------------------------------------
    def _post(self, kind: str, target: object, msg: Message | None) -> None:
        self._outbox.put((kind, target, msg))
        self._wake()

    def _wake(self) -> None:
        if threading.current_thread() is self._thread:
            return  # a handler replying: the loop flushes the outbox before it polls again
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # already pending wake-up, or closing

    def _loop(self) -> None:
        poller = self._poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._wake_r.fileno(), zmq.POLLIN)
        while not self._stop.is_set():
            events = dict(poller.poll(0 if not self._outbox.empty() else POLL_S * 1000))
            if self._wake_r.fileno() in events:
                self._drain_wake()
            self._flush_outbox(poller)
            if self._router in events:
                self._read_router()
            for address, sock in list(self._dealers.items()):
                if sock in events:
                    self._read_dealer(address, sock)
            for fd, (on_readable, on_writable) in list(self._watched.items()):
                if fd not in events:
                    continue
                if events[fd] & zmq.POLLIN and on_readable and self._watched.get(fd, (None,))[0] is on_readable:
                    self._run(on_readable)  # (and not unwatched meanwhile)
                if events[fd] & zmq.POLLOUT and on_writable and self._watched.get(fd, (None, None))[1] is on_writable:
                    self._run(on_writable)
            now = time.monotonic()
            if now >= self._next_housekeeping:  # not after every event: the loop's hot path is a transfer's
                self._next_housekeeping = now + HOUSEKEEPING_S
                self._expire_pending(poller)
                self._close_idle_dealers(poller)
                self._run(self.on_tick)

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
            if kind == "call":
                self._run(target)
                continue
            try:
                frames = self._sealer.frames(encode(msg))
                if kind == "router":
                    self._router.send_multipart([target, *frames], flags=zmq.NOBLOCK)
                elif kind == "dealer_if_open" and target not in self._dealers:
                    logger.debug("control: %s to %s not sent: no open connection", msg.CMD, target)
                else:
                    self._dealer(target, poller).send_multipart(frames, flags=zmq.NOBLOCK)
                    self._last_used[target] = time.monotonic()
            except (zmq.ZMQError, TransferError) as e:
                if kind == "router":  # a consumer that does not read its replies (a flood): log once a minute
                    self._drop("unsendable reply", f"{msg.CMD} reply: {e}")
                else:
                    logger.warning("control: cannot send %s to %r: %s", msg.CMD, target, e)
                self._fail_pending(msg.id, TransferError(f"peer {target!r} unreachable: {e}"))

    def _dealer(self, address: str, poller: zmq.Poller) -> zmq.Socket:
        sock = self._dealers.get(address)
        if sock is None:
            if len(self._dealers) >= self.max_peers and not self._close_one_idle(poller):
                raise TransferError(f"{self.max_peers} peers already connected, all busy")
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://{address}")  # reconnects by itself when the peer restarts
            poller.register(sock, zmq.POLLIN)
            self._dealers[address] = sock
        return sock

    def _close_dealer(self, address: str, poller: zmq.Poller) -> None:
        sock = self._dealers.pop(address)
        self._last_used.pop(address, None)
        poller.unregister(sock)
        sock.close(linger=0)
        logger.debug("control: closed the idle connection to %s", address)

    def _busy_addresses(self) -> set[str]:
        with self._pending_lock:
            return {address for _, _, address in self._pending.values()}

    def _close_one_idle(self, poller: zmq.Poller) -> bool:
        """Make room for a new peer: close the least recently used dealer with nothing pending."""
        busy = self._busy_addresses()
        free = [a for a in self._dealers if a not in busy]
        if not free:
            return False
        self._close_dealer(min(free, key=lambda a: self._last_used.get(a, 0.0)), poller)
        return True

    def _close_idle_dealers(self, poller: zmq.Poller) -> None:
        now = time.monotonic()
        if now < self._next_idle_check:
            return
        self._next_idle_check = now + min(1.0, self.idle_s / 4)
        busy = self._busy_addresses()
        idle = [a for a in self._dealers if a not in busy and now - self._last_used.get(a, 0.0) > self.idle_s]
        for address in idle:
            self._close_dealer(address, poller)

    def _read_router(self) -> None:
        while True:
            try:
                frames = self._router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            payload, reason = self._sealer.open(frames[1:])
            if payload is None:
                self._drop(reason or "frame_count", f"{len(frames) - 1}-frame message")
                continue
            msg = self._decode(payload)
            if msg is not None:
                self._dispatch(self._on_router, frames[0], msg)

    def _read_dealer(self, address: str, sock: zmq.Socket) -> None:
        while True:
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            payload, reason = self._sealer.open(frames)
            if payload is None:
                self._drop(reason or "frame_count", f"reply from {address}")
                continue
            self._last_used[address] = time.monotonic()
            msg = self._decode(payload)
            if msg is None:
                continue
            with self._pending_lock:
                entry = self._pending.pop(msg.id, None) if msg.id else None
            if entry is not None:
                entry[0].set_result(msg)
            else:
                self._dispatch(self._on_dealer, address, msg)

    def _drop(self, reason: str, what: str) -> None:
        """Log a dropped message, at most once a minute per reason (a flood must not flood the log)."""
        now = time.monotonic()
        if now - self._dropped_logged.get(reason, -1e18) >= 60.0:
            self._dropped_logged[reason] = now
            logger.warning("control: dropped a %s (%s); more are not logged for a minute", what, reason)

    @staticmethod
    def _decode(frame: bytes) -> Message | None:
        try:
            return decode(frame)
        except MessageError as e:
            logger.warning("control: dropped a malformed message: %s", e)
            return None

    @staticmethod
    def _run(fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a half's bug must not kill the I/O thread
            logger.exception("control: %r failed on the I/O thread", fn)

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

    def _expire_pending(self, poller: zmq.Poller) -> None:
        now = time.monotonic()
        with self._pending_lock:
            expired = [i for i, (_, deadline, _) in self._pending.items() if deadline <= now]
            entries = [self._pending.pop(i) for i in expired]
        for fut, _, address in entries:
            fut.set_exception(TransferError("no response from peer before the deadline"))
            # A silent peer (a partition: no RST) leaves TCP in retransmission back-off, so the
            # old socket may stay stuck for long after the link is back: open a fresh one. What
            # else waits on the old one went down with it: it fails now (ConnectionReopened),
            # not at its own deadline, so its caller may send it again on the fresh connection.
            if address in self._dealers:
                self._close_dealer(address, poller)
                with self._pending_lock:
                    lost = [i for i, (_, _, a) in self._pending.items() if a == address]
                    lost_entries = [self._pending.pop(i) for i in lost]
                for other, _, _ in lost_entries:
                    other.set_exception(ConnectionReopened(f"connection to {address} reopened after a silent "
                                                           "request; this one was sent on the old one"))
