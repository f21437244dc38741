"""The ``tcp`` data plane: one plain TCP connection per (producer, consumer) pair.

A KV message goes out one ``sendmsg`` per layer, straight from the blocks (the kernel
gathers a layer's scattered block runs: no gather copy), and is received layer by layer
with ``recvmsg_into`` straight into the destination blocks (no staging copy); each side
builds a layer's buffer list just before that layer moves. Each KV message travels
behind a small :class:`Frame` header on the same stream (request id, layers, block count,
payload bytes), so the consumer reads it as soon as it arrives instead of waiting for a
notice to cross the control plane: two thread hops and two ZMQ hops less per message.
The payload is each layer's ``[2, blocks, ...]`` in C order.

The endpoint's I/O thread moves the bytes without ever waiting (:class:`FrameReader`,
:class:`FrameWriter`: what the socket cannot take or give now moves when it is ready), and
fails a message that moved no byte for ``timeout_s``, so a stalled peer is noticed that soon
while a slow link that keeps moving is not cut off. The blocking calls (``send``,
``recv_into``: kernel socket timeouts per call) build the pair and serve tests. A closed connection, a reset or a timeout marks the pair broken, like a gloo pair
after a timeout.
The connection opens with a hello (pair_auth.py): the pair id, and with a cluster key a
mutual challenge-response over the key, so the producer accepts only the consumer it handed
the port to over the control plane, and a stranger's connection never becomes the pair's.
"""

from __future__ import annotations

import ctypes
import fcntl
import math
import select
import socket
import struct
import termios
import time
from dataclasses import dataclass

import torch

from common.cluster_auth import ClusterKey
from common.kv_transfer.config import PairBrokenError
from common.kv_transfer.pair_auth import accept_peer, connect_hello
from common.kv_transfer.paged import StagingBuffer, block_runs, gather_blocks, scatter_blocks

IOV_MAX = 1024  # per sendmsg/recvmsg call (Linux's limit)
FRAME_MAGIC = b"PDKV"
FRAME_VERSION = 1
KV, MESSAGE = 1, 2  # frame kinds: KV bytes (producer -> consumer); a control message (consumer -> producer)
MAX_MESSAGE_BYTES = 1 << 20
# The consumer's send buffer (the kernel doubles it; capped by net.core.wmem_max): the producer
# reads its socket only between sends, so the consumer must be able to queue its messages meanwhile.
MESSAGE_BUFFER_BYTES = 4 << 20
# magic, version, kind, request-id bytes, layers, blocks, payload bytes
_FRAME = struct.Struct("!4sBBHHIQ")
_DISCARD_CHUNK = 1 << 20


@dataclass(frozen=True)
class Frame:
    """The header in front of one message on a tcp pair. ``KV``: ``nbytes`` of ``layers`` of
    ``request_id``, ``num_blocks`` blocks each (the consumer's first blocks of the request).
    ``MESSAGE``: ``nbytes`` of an encoded control message (a PULL, sent where the bytes flow)."""

    request_id: str
    layers: tuple[int, ...]
    num_blocks: int
    nbytes: int
    kind: int = KV
    payload: bytes = b""  # a received MESSAGE's bytes, read with its header (one receive less)

    def encode(self) -> bytes:
        rid = self.request_id.encode()
        return _FRAME.pack(FRAME_MAGIC, FRAME_VERSION, self.kind, len(rid), len(self.layers), self.num_blocks,
                           self.nbytes) + rid + struct.pack(f"!{len(self.layers)}H", *self.layers)


def tensor_buffer(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (the tensor must outlive it)."""
    if not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError("tcp data-plane tensors must be contiguous CPU tensors")
    nbytes = t.numel() * t.element_size()
    return memoryview((ctypes.c_ubyte * nbytes).from_address(t.data_ptr())).cast("B")


def layer_buffers(kv: torch.Tensor, runs: list[slice]) -> list[memoryview]:
    """Byte views whose concatenation is ``kv[:, blocks]`` in C order (keys, then values), one
    per run of blocks (what ``sendmsg``/``recvmsg_into`` gather from or scatter into). Sliced
    out of one view of the layer: a tensor view per block costs ~30 µs, a slice ~0.3."""
    whole = tensor_buffer(kv)
    block = kv.stride(1) * kv.element_size()
    half = kv.stride(0) * kv.element_size()  # keys, then values
    return [whole[k * half + r.start * block: k * half + r.stop * block] for k in (0, 1) for r in runs]


def kv_nbytes(kv_caches, layers, num_blocks: int) -> int:
    """Bytes of ``num_blocks`` blocks of each of ``layers`` (keys and values)."""
    # from the shape, not the strides: a cache may be a slice of the heads (tp_ranks's routes)
    return sum(2 * num_blocks * math.prod(kv_caches[x].shape[2:]) * kv_caches[x].element_size() for x in layers)


def kv_message(request_id: str, kv_caches, layers, block_ids: list[int], trailer: bytes = b""):
    """(KV bytes, the message's byte views one layer at a time): the header, each layer's
    ``[2, blocks, ...]`` straight from its blocks (the kernel gathers a layer's scattered runs:
    no copy), ``trailer`` behind the last. Each layer's views are built just before it goes:
    the first bytes leave at once instead of after every layer's views are built (~1 ms for
    32 layers of scattered blocks). A slice of the heads (tensor parallelism) is gathered first."""
    nbytes = kv_nbytes(kv_caches, layers, len(block_ids))
    head = memoryview(Frame(request_id, tuple(layers), len(block_ids), nbytes).encode())

    def parts():
        runs = block_runs(block_ids)
        for i, layer in enumerate(layers):
            kv = kv_caches[layer]
            if kv.is_contiguous():
                bufs = layer_buffers(kv, runs)
            else:  # the gathered copy lives as long as its views (they hold this frame)
                kv = gather_blocks(kv, block_ids)
                bufs = layer_buffers(kv, [slice(0, len(block_ids))])
            if i == 0:
                bufs.insert(0, head)
            if i == len(layers) - 1 and trailer:
                bufs.append(memoryview(trailer))
            yield bufs
    return nbytes, parts()


class FrameWriter:
    """Sends a message without ever waiting: :meth:`push` sends what the socket takes and
    returns True once every byte is out; the I/O thread calls it again when the socket is
    writable. ``parts`` yields lists of byte views (one layer's at a time)."""

    def __init__(self, pair: TcpPair, parts) -> None:
        self._pair, self._parts = pair, iter(parts)
        self._bufs: list[memoryview] = []
        self._i = 0
        self.last_byte = time.monotonic()
        self._queued = -1

    def last_progress(self) -> float:
        """When a byte last moved: into the socket, or out of it to the peer (the kernel's send
        queue shrank). On a slow lossy link the socket may take nothing for seconds while the wire
        drains what it holds: that is progress, not a stalled peer."""
        queued = self._pair.queued_bytes()
        if queued != self._queued:
            self._queued, self.last_byte = queued, time.monotonic()
        return self.last_byte

    def push(self) -> bool:
        while True:
            if self._i == len(self._bufs):
                bufs = next(self._parts, None)
                if bufs is None:
                    return True
                self._bufs, self._i = [b for b in bufs if len(b)], 0
                continue
            n = self._pair.send_some(self._bufs[self._i:self._i + IOV_MAX])
            if n == 0:
                return False
            self.last_byte = time.monotonic()
            while n:  # advance past what moved; a partial buffer keeps its tail
                if n >= len(self._bufs[self._i]):
                    n -= len(self._bufs[self._i])
                    self._i += 1
                else:
                    self._bufs[self._i], n = self._bufs[self._i][n:], 0


class PeerClosedError(PairBrokenError):
    """The peer closed the connection (at a message boundary: an idle pair's normal end)."""


def kv_views(kv_caches, layers, block_ids: list[int], staging: StagingBuffer) -> tuple[list[memoryview], object]:
    """Byte views that a ``KV`` message of ``layers`` x ``block_ids`` lands in, in wire order,
    and what to call once every byte is in: straight into the blocks where a layer is
    contiguous (nothing to do after); a slice of the heads (tensor parallelism) lands in
    ``staging`` and is scattered into its blocks after."""
    runs = block_runs(block_ids)
    views: list[memoryview] = []
    staged: list[tuple[torch.Tensor, torch.Tensor]] = []
    sliced = [x for x in layers if not kv_caches[x].is_contiguous()]
    if sliced:
        kv0 = kv_caches[sliced[0]]
        buf = staging.view(kv0.dtype, (len(sliced), 2, len(block_ids), *kv0.shape[2:]))
    for layer in layers:
        kv = kv_caches[layer]
        if kv.is_contiguous():
            views += layer_buffers(kv, runs)
        else:
            part = buf[len(staged)]
            staged.append((kv, part))
            views.append(tensor_buffer(part))

    def scatter() -> None:
        for kv, part in staged:
            scatter_blocks(kv, block_ids, part)
    return views, scatter


def scratch_views(nbytes: int) -> list[memoryview]:
    """Views adding up to ``nbytes`` that all land in one scratch buffer: a message nobody waits for."""
    scratch = memoryview(bytearray(min(nbytes, _DISCARD_CHUNK)))
    full, rest = divmod(nbytes, len(scratch)) if nbytes else (0, 0)
    return [scratch] * full + ([scratch[:rest]] if rest else [])


class FrameReader:
    """A tcp pair's incoming frames, read without ever waiting: the I/O thread calls :meth:`feed`
    whenever the socket is readable, and it reads what is there and returns. A ``KV`` frame's
    payload goes where ``on_kv(frame)`` says (byte views adding up to ``frame.nbytes``, and what
    to call once they are full); a ``MESSAGE`` frame goes to ``on_message(frame)``.
    :meth:`divert` sends the rest of the payload in progress to scratch (its request was
    dropped: its blocks may be reused at once)."""

    def __init__(self, pair: TcpPair, on_kv, on_message) -> None:
        self.pair, self._on_kv, self._on_message = pair, on_kv, on_message
        self._fixed = bytearray(_FRAME.size)
        self.closed = False
        self.last_byte = time.monotonic()
        self._reset()

    def _reset(self) -> None:
        self._expect([memoryview(self._fixed)])
        self._stage = "head"
        self._frame: Frame | None = None
        self._then = None
        self.request_id = ""  # whose blocks the payload in progress lands in

    def mid_frame(self) -> bool:
        """Part of a frame is in, the rest not yet (its silence is a stalled peer's)."""
        return self._stage != "head" or self._i > 0 or len(self._bufs[0]) < _FRAME.size

    def divert(self) -> None:
        """The payload in progress goes to scratch from here on (same byte count)."""
        if self._stage == "body":
            self._expect(scratch_views(sum(len(b) for b in self._bufs[self._i:])))
            self._then, self.request_id = None, ""

    def _expect(self, bufs: list[memoryview]) -> None:
        self._bufs, self._i = [b for b in bufs if len(b)], 0

    def feed(self) -> None:
        """Read until the socket would block (or this reader is closed by a callback)."""
        while not self.closed:
            n = self.pair.recv_some(self._bufs[self._i:self._i + IOV_MAX])
            if n == 0:
                return
            self.last_byte = time.monotonic()
            bufs = self._bufs
            while n:  # advance past what moved; a partial buffer keeps its tail
                if n >= len(bufs[self._i]):
                    n -= len(bufs[self._i])
                    self._i += 1
                else:
                    bufs[self._i], n = bufs[self._i][n:], 0
            while self._i == len(self._bufs) and not self.closed:
                self._next()

    def _next(self) -> None:
        """The part in progress is full: parse it and go on to the next part (or frame)."""
        if self._stage == "head":
            magic, version, kind, rid_len, num_layers, num_blocks, nbytes = _FRAME.unpack(self._fixed)
            if magic != FRAME_MAGIC or version != FRAME_VERSION or kind not in (KV, MESSAGE) \
                    or (kind == MESSAGE and nbytes > MAX_MESSAGE_BYTES):
                self.pair.close()  # out of step with the peer: nothing after this can be trusted
                raise PairBrokenError(f"tcp pair out of step: bad frame header {bytes(self._fixed[:5])!r}")
            head = rid_len + 2 * num_layers
            self._rest = bytearray(head + nbytes if kind == MESSAGE else head)
            self._head = (kind, rid_len, num_layers, num_blocks, nbytes)
            self._stage = "rest"
            self._expect([memoryview(self._rest)])
        elif self._stage == "rest":
            kind, rid_len, num_layers, num_blocks, nbytes = self._head
            head = rid_len + 2 * num_layers
            layers = struct.unpack_from(f"!{num_layers}H", self._rest, rid_len)
            frame = Frame(self._rest[:rid_len].decode(errors="replace"), layers, num_blocks, nbytes, kind,
                          bytes(self._rest[head:]) if kind == MESSAGE else b"")
            if kind == MESSAGE:
                self._reset()
                self._on_message(frame)
                return
            views, self._then = self._on_kv(frame)
            self._frame, self.request_id = frame, frame.request_id
            self._stage = "body"
            self._expect(views)
        else:
            then = self._then
            self._reset()
            if then is not None:
                then()


class TcpListener:
    """The producer's side before the consumer connects: a listening socket on a free port."""

    def __init__(self, host: str, timeout_s: float) -> None:
        self.host = host
        self._sock = socket.create_server((host, 0))
        self._sock.settimeout(timeout_s)
        self.port: int = self._sock.getsockname()[1]

    def accept(self, pair_id: str, key: ClusterKey | None = None) -> socket.socket:
        """The consumer's connection that completes the hello for ``pair_id`` (pair_auth.py);
        others are closed, and the listening socket goes once ours is in."""
        try:
            return accept_peer(self._sock, pair_id, key, self._sock.gettimeout() or 10.0)
        finally:
            self._sock.close()

    def cancel(self) -> None:
        """Stop waiting for the consumer (from another thread): a waiting accept raises at once."""
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # accept already ended

    def close(self) -> None:
        self._sock.close()


class TcpPair:
    """Rank ``rank`` (0 = producer, 1 = consumer) of a pair over one TCP connection.

    Construction blocks until the peer is there: build it on a background thread."""

    backend = "tcp"

    def __init__(self, rank: int, timeout_s: float, pair_id: str, *, listener: TcpListener | None = None,
                 host: str = "", port: int = 0, connect_timeout_s: float | None = None,
                 key: ClusterKey | None = None) -> None:
        self.rank, self.timeout_s, self.broken = rank, timeout_s, False
        try:
            if rank == 0:
                assert listener is not None
                self._sock = listener.accept(pair_id, key)
            else:
                self._sock = socket.create_connection((host, port), timeout=timeout_s)
                connect_hello(self._sock, pair_id, key)
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if rank == 1:  # room for many PULLs/ACKs while the producer is busy in one long send
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, MESSAGE_BUFFER_BYTES)
            # Blocking socket with kernel-side deadlines: one recvmsg(MSG_WAITALL) fills a whole
            # message in one call (Python's own timeouts add a poll() per partial read).
            self._sock.settimeout(None)
            self._kernel_timeout = 0.0
            self._set_kernel_timeout(timeout_s)
            # One tiny round trip proves both directions work before real data flows; it is
            # part of the set-up, so it may take ``connect_timeout_s``.
            probe = torch.zeros(1, dtype=torch.int64)
            if rank == 0:
                self.send([probe], connect_timeout_s)
            else:
                self.recv_into([probe], connect_timeout_s)
        except (OSError, PairBrokenError) as e:
            self.broken = True
            raise PairBrokenError(f"building the tcp pair failed: {e}") from e

    # ---- the PairGroup interface ----------------------------------------------------
    # ``tensors``: contiguous CPU tensors or byte views of them (see :func:`layer_buffers`)
    def send(self, tensors: list[torch.Tensor], timeout_s: float | None = None) -> None:
        self._io(self._sock.sendmsg, tensors, timeout_s)

    def recv_into(self, tensors: list[torch.Tensor], timeout_s: float | None = None) -> None:
        """Receive one message into ``tensors`` (their sizes must add up to the sender's)."""
        self._io(lambda bufs: self._sock.recvmsg_into(bufs, 0, socket.MSG_WAITALL)[0], tensors, timeout_s)

    def send_kv(self, request_id: str, kv_caches, layers: list[int], block_ids: list[int],
                trailer: bytes = b"") -> int:
        """Send ``layers`` of ``block_ids`` as one ``KV`` message straight from the blocks, and
        ``trailer`` (an encoded message frame, e.g. DONE) right behind it, waiting until it is
        out; returns the KV bytes (:func:`kv_message` has the layout)."""
        nbytes, parts = kv_message(request_id, kv_caches, layers, block_ids, trailer)
        for bufs in parts:
            self.send(bufs)
        return nbytes

    @staticmethod
    def message_frame(payload: bytes) -> bytes:
        """An encoded control message as it travels on the pair (header + payload)."""
        return Frame("", (), 0, len(payload), MESSAGE).encode() + payload

    def send_message(self, payload: bytes) -> None:
        """Send an encoded control message to the peer (a ``MESSAGE`` frame)."""
        self.send([memoryview(self.message_frame(payload))])

    def fileno(self) -> int:
        """The socket's descriptor, to wait for the next message with ``select``."""
        return self._sock.fileno()

    def queued_bytes(self) -> int:
        """Bytes in the kernel's send queue, not yet acknowledged by the peer (-1 when unknown)."""
        try:
            return struct.unpack("i", fcntl.ioctl(self._sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
        except OSError:
            return -1

    def send_some(self, bufs: list[memoryview]) -> int:
        """Send what the socket takes of ``bufs`` (in order, at most IOV_MAX) without waiting; 0
        when it takes nothing."""
        if self.broken:
            raise PairBrokenError("pair is broken; rebuild it")
        try:
            return self._sock.sendmsg(bufs, [], socket.MSG_DONTWAIT)
        except BlockingIOError:
            return 0
        except OSError as e:
            self.broken = True
            raise PairBrokenError(f"tcp transfer failed: {e}") from e

    def recv_some(self, bufs: list[memoryview]) -> int:
        """Receive what is there into ``bufs`` (in order, at most IOV_MAX) without waiting; 0 when
        nothing is."""
        if self.broken:
            raise PairBrokenError("pair is broken; rebuild it")
        try:
            n = self._sock.recvmsg_into(bufs, 0, socket.MSG_DONTWAIT)[0]
        except BlockingIOError:
            return 0
        except OSError as e:
            self.broken = True
            raise PairBrokenError(f"tcp transfer failed: {e}") from e
        if n == 0:
            self.broken = True
            raise PeerClosedError("peer closed the connection")
        return n

    def alive(self) -> bool:
        """False once the peer closed the connection (checked without blocking: readable with
        nothing to read is the close; readable with bytes is the next message)."""
        if self.broken:
            return False
        try:
            readable, _, _ = select.select([self._sock], [], [], 0)
            return not readable or self._sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) != b""
        except OSError:
            return False

    def close(self) -> None:
        """Close the connection: the peer's pending operation fails at once."""
        self.broken = True
        sock = getattr(self, "_sock", None)
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()

    # ---- internals ------------------------------------------------------------------
    def _set_kernel_timeout(self, timeout_s: float) -> None:
        if timeout_s == self._kernel_timeout:
            return
        timeval = struct.pack("ll", int(timeout_s), int(timeout_s % 1 * 1_000_000))
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)
        self._kernel_timeout = timeout_s

    def _io(self, call, tensors: list[torch.Tensor], timeout_s: float | None) -> None:
        """Run ``call`` (sendmsg or recvmsg_into) until every byte of ``tensors`` moved.

        The deadline bounds silence, not size: each call waits at most ``timeout_s`` for a byte
        to move (the kernel's SO_RCVTIMEO/SO_SNDTIMEO), so a dead or partitioned peer fails the
        message that long after its last byte, while a slow link that keeps moving (high
        latency, loss) finishes a large layer however long it takes."""
        if self.broken:
            raise PairBrokenError("pair is broken; rebuild it")
        bufs = [b for b in (t if type(t) is memoryview else tensor_buffer(t) for t in tensors) if len(b)]
        i = 0
        try:
            if (timeout_s or self.timeout_s) != self._kernel_timeout:
                self._set_kernel_timeout(timeout_s or self.timeout_s)
            while i < len(bufs):
                try:
                    n = call(bufs[i:i + IOV_MAX])
                except BlockingIOError as e:  # SO_RCVTIMEO/SO_SNDTIMEO ran out with nothing moved
                    raise TimeoutError(f"no byte moved for {timeout_s or self.timeout_s:g} s") from e
                if n == 0:
                    raise ConnectionError("peer closed the connection")
                while n:  # advance past what moved; a partial buffer keeps its tail
                    if n >= len(bufs[i]):
                        n -= len(bufs[i])
                        i += 1
                    else:
                        bufs[i], n = bufs[i][n:], 0
        except OSError as e:  # timeouts, resets and EOF are all OSErrors
            self.broken = True
            raise PairBrokenError(f"tcp transfer failed: {e}") from e
