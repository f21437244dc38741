"""Who may join a data-plane pair (issue 22): the tcp pair's connect hello and the store prefix
of a gloo/NCCL pair.

tcp, with a cluster key, is a mutual challenge-response (the key never travels)::

    producer (accepts)                    consumer (connects)
    "PDKA" | nonce_p          ------>
                              <------     pair_id | nonce_c | HMAC(key, consumer, pair_id, nonce_p, nonce_c)
    HMAC(key, producer, pair_id, nonce_c, nonce_p)  ------>

A connection whose hello is wrong, short or later than :data:`HELLO_TIMEOUT_S` is closed before
it is ever the pair's socket, so it moves no byte into a block; hellos are read side by side
(``select``), so one silent stranger does not hold up the honest consumer. Without a key the
consumer sends the pair id alone (the random id the control plane handed out), as before.

gloo/NCCL pairs meet on a ``TCPStore``, whose wire has no place for a handshake: each pair's
keys live under a prefix nobody outside the pair knows (with a key, an HMAC of the pair id;
without, the random pair id), so a stranger on the store port cannot set or read them.
"""

from __future__ import annotations

import errno
import hmac
import logging
import secrets
import select
import socket
import time

from common.cluster_auth import ClusterKey
from common.kv_transfer.config import PairBrokenError

logger = logging.getLogger(__name__)

CHALLENGE_MAGIC = b"PDKA"
NONCE_BYTES = 16
PROOF_BYTES = 32
HELLO_TIMEOUT_S = 5.0  # one connection's hello, at most (or the pair's set-up bound, if shorter)
MAX_PENDING_HELLOS = 16  # past this the oldest unfinished hello is dropped
_CONNECT, _STORE = b"pdserve-kv-connect", b"pdserve-kv-store"
_CONSUMER, _PRODUCER = b"consumer", b"producer"


class PairAuthError(PairBrokenError):
    """The peer did not prove the cluster key at the pair's connect."""


def _proof(key: ClusterKey, role: bytes, pair_id: str, theirs: bytes, mine: bytes) -> bytes:
    return key.mac(_CONNECT, role, pair_id.encode(), theirs, mine)


def store_prefix(key: ClusterKey | None, pair_id: str) -> str:
    """The prefix of one gloo/NCCL pair's store keys (the same on both sides)."""
    secret = key.mac(_STORE, pair_id.encode()).hex() if key is not None else pair_id
    return f"pdserve-pair/{secret}/"


def hello_size(key: ClusterKey | None, pair_id: str) -> int:
    """Bytes of the consumer's hello."""
    return len(pair_id.encode()) + (NONCE_BYTES + PROOF_BYTES if key is not None else 0)


class _Hello:
    """One accepted connection whose hello is not complete yet."""

    def __init__(self, conn: socket.socket, deadline: float, nonce: bytes) -> None:
        self.conn, self.deadline, self.nonce, self.buf = conn, deadline, nonce, b""


def accept_peer(server: socket.socket, pair_id: str, key: ClusterKey | None, timeout_s: float) -> socket.socket:
    """The first connection to ``server`` that completes the hello for ``pair_id`` (blocking,
    the hello finished); others are closed. :class:`TimeoutError` after ``timeout_s``;
    :class:`ConnectionAbortedError` once ``server`` was shut down (the pair was dropped)."""
    deadline = time.monotonic() + timeout_s
    per_hello = min(HELLO_TIMEOUT_S, timeout_s)
    need = hello_size(key, pair_id)
    pending: dict[socket.socket, _Hello] = {}
    try:
        while True:
            now = time.monotonic()
            for h in [h for h in pending.values() if h.deadline <= now]:
                _drop(pending, h, "no hello in time")
            if now >= deadline:
                raise TimeoutError(f"no consumer joined pair {pair_id[:8]} within {timeout_s:g} s")
            wait = min([deadline, *(h.deadline for h in pending.values())]) - now
            ready, _, _ = select.select([server, *pending], [], [], max(0.0, wait))
            for s in ready:
                if s is server:
                    _admit(server, pending, key, now + per_hello)
                    continue
                h = pending[s]
                try:
                    chunk = s.recv(need - len(h.buf))
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if not chunk:
                    _drop(pending, h, "closed before its hello")
                    continue
                h.buf += chunk
                if len(h.buf) < need:
                    continue
                del pending[s]
                if _answer(h, pair_id, key):
                    return s
                s.close()
    finally:
        for h in list(pending.values()):
            h.conn.close()


def _admit(server: socket.socket, pending: dict, key: ClusterKey | None, deadline: float) -> None:
    try:
        conn, _ = server.accept()
    except OSError as e:  # a connection reset before we took it, out of descriptors: try the next
        if e.errno == errno.EINVAL:  # shut down (TcpListener.cancel): nobody is to join any more
            raise ConnectionAbortedError("the pair was dropped before its consumer joined") from e
        return
    if len(pending) >= MAX_PENDING_HELLOS:
        _drop(pending, min(pending.values(), key=lambda h: h.deadline), "too many unfinished hellos")
    conn.setblocking(False)
    nonce = secrets.token_bytes(NONCE_BYTES) if key is not None else b""
    try:
        if key is not None:
            conn.send(CHALLENGE_MAGIC + nonce)  # 20 bytes into an empty buffer: never partial
    except OSError:
        conn.close()
        return
    pending[conn] = _Hello(conn, deadline, nonce)


def _drop(pending: dict, h: _Hello, why: str) -> None:
    pending.pop(h.conn, None)
    logger.info("kv data plane: dropped a connection: %s", why)
    h.conn.close()


def _answer(h: _Hello, pair_id: str, key: ClusterKey | None) -> bool:
    """Check a complete hello; with a key, answer it with our own proof."""
    ident = pair_id.encode()
    if not hmac.compare_digest(h.buf[:len(ident)], ident):
        logger.warning("kv data plane: a connection named another pair (a stranger or a stale consumer); closed")
        return False
    if key is None:
        h.conn.setblocking(True)
        return True
    nonce_c, proof_c = h.buf[len(ident):len(ident) + NONCE_BYTES], h.buf[len(ident) + NONCE_BYTES:]
    if not hmac.compare_digest(proof_c, _proof(key, _CONSUMER, pair_id, h.nonce, nonce_c)):
        logger.warning("kv data plane: a consumer failed the cluster-key proof for pair %s (a stranger, or a "
                       "daemon with another --cluster-key-file); closed", pair_id[:8])
        return False
    h.conn.settimeout(HELLO_TIMEOUT_S)  # blocking again, bounded
    try:
        h.conn.sendall(_proof(key, _PRODUCER, pair_id, nonce_c, h.nonce))
    except OSError:
        return False
    return True


def connect_hello(sock: socket.socket, pair_id: str, key: ClusterKey | None) -> None:
    """The consumer's side of the hello on a fresh connection (its timeout bounds each read)."""
    if key is None:
        sock.sendall(pair_id.encode())
        return
    where = "%s:%s" % sock.getpeername()[:2]
    try:
        challenge = _recv_exact(sock, len(CHALLENGE_MAGIC) + NONCE_BYTES)
        if not challenge.startswith(CHALLENGE_MAGIC):
            raise PairAuthError(f"the producer at {where} sent no cluster-key challenge (is it keyless?)")
        nonce_p, nonce_c = challenge[len(CHALLENGE_MAGIC):], secrets.token_bytes(NONCE_BYTES)
        sock.sendall(pair_id.encode() + nonce_c + _proof(key, _CONSUMER, pair_id, nonce_p, nonce_c))
        answer = _recv_exact(sock, PROOF_BYTES)
    except ConnectionError as e:
        raise PairAuthError(f"the producer at {where} closed the pair at the cluster-key check: it does not "
                            "hold our key (the same --cluster-key-file on both daemons?)") from e
    if not hmac.compare_digest(answer, _proof(key, _PRODUCER, pair_id, nonce_c, nonce_p)):
        raise PairAuthError(f"the producer at {where} failed the cluster-key proof: it does not hold our key")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("peer closed the connection")
        buf += chunk
    return buf
