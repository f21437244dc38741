"""The cluster secret: who may join the cluster and which request ids the proxy made.

One key file (``--cluster-key-file``) is shared by the proxy and every daemon. From it:

- **signed request ids**: the proxy signs each leg it sends (HMAC-SHA256 over the tagged id
  -- tags and uuid --, an expiry, the leg's role and the SHA-256 of the leg's exact body) and
  sends ``X-PDServe-Signature: v2.<expiry>.<body sha256 hex>.<mac hex>``; a daemon checks the
  MAC against its own role before it reads the body, parses an address, allocates a block or
  opens a socket, then checks the body it read has that digest (``signed_body_digest``), and accepts each signature
  once. So a signature made for one leg is good for no other role and no other body.
- **sealed messages**: registry heartbeats and P<->D control messages travel as
  ``[payload, seal]`` where the seal is ``v1 | unix ms | nonce | HMAC(purpose, ms, nonce,
  payload)``; a receiver accepts a seal only within ``window_s`` of its clock and only once.

Without a key nothing is signed and the wire stays vLLM's (loopback and trusted networks).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import struct
import threading
import time
from collections import OrderedDict
from pathlib import Path

logger = logging.getLogger(__name__)

SIGNATURE_HEADER = "X-PDServe-Signature"
ID_TTL_S = 120.0  # a signed id must reach its daemon this soon after the proxy made it
SEAL_WINDOW_S = 30.0  # clock skew + transit a sealed message may show
MIN_KEY_BYTES = 16
_SEAL = struct.Struct(">BQ8s32s")  # version, unix ms, nonce, mac
_SEAL_VERSION = 1
_REGISTRY, _CONTROL, _REQUEST_ID = b"pdserve-registry", b"pdserve-kv-control", b"pdserve-request-id"
_KV_EVENTS = b"pdserve-kv-events"


class ClusterKeyError(ValueError):
    """The key file is missing, unreadable or too short."""


class ClusterKey:
    """The shared secret; ``load`` reads it from a file, ``generate`` writes a new one."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_KEY_BYTES:
            raise ClusterKeyError(f"cluster key must have at least {MIN_KEY_BYTES} bytes, got {len(secret)}")
        self._secret = secret

    @classmethod
    def load(cls, path: str | os.PathLike) -> ClusterKey:
        p = Path(path).expanduser()
        try:
            secret = p.read_bytes().strip()
        except OSError as exc:
            raise ClusterKeyError(f"cannot read the cluster key file {p}: {exc.strerror or exc}") from exc
        if p.stat().st_mode & 0o077:
            logger.warning("cluster key file %s is readable by other users; chmod 600 it", p)
        try:
            return cls(secret)
        except ClusterKeyError as exc:
            hint = 'make one with: python3 -c "import secrets; print(secrets.token_hex(32))"'
            raise ClusterKeyError(f"{p}: {exc} ({hint})") from exc

    @classmethod
    def optional(cls, path: str | None) -> ClusterKey | None:
        return None if not path else cls.load(path)

    @staticmethod
    def generate(path: str | os.PathLike) -> Path:
        """Write a fresh random key (hex, mode 0600) to ``path``; returns the path."""
        p = Path(path)
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
        os.chmod(p, 0o600)  # O_CREAT's mode does not apply to a file that already existed
        return p

    def mac(self, purpose: bytes, *parts: bytes) -> bytes:
        h = hmac.new(self._secret, purpose, hashlib.sha256)
        for part in parts:  # length-prefixed: no two part lists hash alike
            h.update(struct.pack(">Q", len(part)))
            h.update(part)
        return h.digest()

    # ---- request ids -------------------------------------------------------------------
    def sign_id(self, request_id: str, role: str, body: bytes, ttl_s: float = ID_TTL_S) -> str:
        """The signature of one leg: ``request_id`` sent to a ``role`` daemon with exactly ``body``."""
        expiry, digest = str(int(time.time() + ttl_s)), hashlib.sha256(body).hexdigest()
        mac = self.mac(_REQUEST_ID, request_id.encode(), expiry.encode(), role.encode(), digest.encode())
        return f"v2.{expiry}.{digest}.{mac.hex()}"

    def check_id(self, request_id: str, signature: str | None, role: str) -> str | None:
        """None when ``signature`` is this key's for ``request_id`` sent to a ``role`` daemon and
        unexpired, else why not. The body is not read yet: check it with :meth:`signed_body_digest`."""
        if not signature:
            return f"missing {SIGNATURE_HEADER} header"
        version, _, rest = signature.partition(".")
        expiry, _, rest = rest.partition(".")
        digest, _, mac_hex = rest.partition(".")
        if version != "v2" or not expiry.isdigit() or len(expiry) > 12 or len(digest) != 64:
            return f"malformed {SIGNATURE_HEADER} header"
        parts = (request_id.encode(), expiry.encode(), role.encode(), digest.encode("utf-8", "surrogateescape"))
        want = self.mac(_REQUEST_ID, *parts).hex().encode()
        # as bytes: compare_digest raises TypeError on a str with non-ASCII characters (a header's bytes)
        if not hmac.compare_digest(want, mac_hex.encode("utf-8", "surrogateescape")):
            return f"request id signature does not match (not signed by this cluster's proxy for a {role} node)"
        if int(expiry) < time.time():
            return "request id signature expired"
        return None

    @staticmethod
    def signed_body_digest(signature: str) -> str:
        """The body digest a (checked) ``v2`` signature names: the body read must hash to it."""
        return signature.split(".")[2]

    # ---- sealed messages ---------------------------------------------------------------
    def seal(self, purpose: bytes, payload: bytes) -> bytes:
        ms, nonce = int(time.time() * 1000), secrets.token_bytes(8)
        return _SEAL.pack(_SEAL_VERSION, ms, nonce, self.mac(purpose, struct.pack(">Q", ms), nonce, payload))


class ReplayWindow:
    """Tokens seen in the last ``window_s``: each is accepted once. Bounded: the oldest go
    first past ``max_entries`` (a flood cannot grow it, and what is pushed out is expired soon)."""

    def __init__(self, window_s: float, max_entries: int = 200_000) -> None:
        self.window_s, self.max_entries = window_s, max_entries
        self._seen: OrderedDict[bytes, float] = OrderedDict()
        self._lock = threading.Lock()

    def first_time(self, token: bytes, now: float | None = None) -> bool:
        now = time.monotonic() if now is None else now
        with self._lock:
            seen = self._seen  # insertion order is expiry order: the oldest go first
            while seen and (len(seen) >= self.max_entries or next(iter(seen.values())) < now):
                seen.popitem(last=False)
            if token in self._seen:
                return False
            self._seen[token] = now + self.window_s
            return True


class SealChecker:
    """Checks ``[payload, seal]`` frames for one purpose: right key, fresh, not replayed."""

    def __init__(self, key: ClusterKey, purpose: bytes, window_s: float = SEAL_WINDOW_S) -> None:
        self.key, self.purpose, self.window_s = key, purpose, window_s
        self._replays = ReplayWindow(2 * window_s)

    def check(self, payload: bytes, seal: bytes | None) -> str | None:
        """None when the seal is good, else a short reason (used as a metric label)."""
        if seal is None:
            return "unauthenticated"
        if len(seal) != _SEAL.size:
            return "bad_seal"
        version, ms, nonce, mac = _SEAL.unpack(seal)
        if version != _SEAL_VERSION:
            return "bad_seal"
        if not hmac.compare_digest(mac, self.key.mac(self.purpose, struct.pack(">Q", ms), nonce, payload)):
            return "bad_signature"
        if abs(time.time() - ms / 1000) > self.window_s:
            return "stale"
        if not self._replays.first_time(mac):
            return "replayed"
        return None


class Sealer:
    """Both ends of one purpose's framing: ``frames(payload)`` to send, ``open(frames)`` to receive.

    Keyless, a message is the one payload frame (vLLM's wire); with a key, ``[payload, seal]``."""

    def __init__(self, key: ClusterKey | None, purpose: bytes) -> None:
        self.key, self.purpose = key, purpose
        self._checker = SealChecker(key, purpose) if key is not None else None

    def frames(self, payload: bytes) -> list[bytes]:
        return [payload] if self.key is None else [payload, self.key.seal(self.purpose, payload)]

    def open(self, frames: list[bytes]) -> tuple[bytes | None, str | None]:
        """(payload, None) when acceptable, else (None, reason)."""
        if self._checker is None:
            return (frames[0], None) if len(frames) == 1 else (None, "frame_count")
        if len(frames) == 1:
            return None, "unauthenticated"
        if len(frames) != 2:
            return None, "frame_count"
        reason = self._checker.check(frames[0], frames[1])
        return (frames[0], None) if reason is None else (None, reason)


def registry_sealer(key: ClusterKey | None) -> Sealer:
    """Heartbeats to the proxy's registry."""
    return Sealer(key, _REGISTRY)


def control_sealer(key: ClusterKey | None) -> Sealer:
    """P<->D KV control messages (a seal for one purpose is never valid for the other)."""
    return Sealer(key, _CONTROL)


def kv_events_sealer(key: ClusterKey | None) -> Sealer:
    """A daemon's KV events and their replay (common/kv_events.py)."""
    return Sealer(key, _KV_EVENTS)


ADMIN_ROLE = "admin"  # the role word of a signed admin call (a daemon's POST /admin/role), never a node's


def admin_headers(key: ClusterKey, body: bytes) -> dict[str, str]:
    """The headers that authenticate an admin call (``POST /admin/role``, common/node/role_routes.py)
    with exactly ``body``: a fresh id signed for the ``admin`` role, accepted once."""
    request_id = f"admin-{secrets.token_hex(16)}"
    return {"X-Request-Id": request_id, SIGNATURE_HEADER: key.sign_id(request_id, ADMIN_ROLE, body)}


def is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


def warn_if_open(what: str, host: str, key: ClusterKey | None, exposure: str) -> None:
    """The start-up warning for a process that binds a non-loopback address without a key."""
    if key is None and not is_loopback(host):
        logger.warning("%s binds %s without a cluster key: anyone who can reach it can %s. "
                       "Set --cluster-key-file (the same file on proxy, prefill and decode) or "
                       "firewall it.", what, host, exposure)


def check_key_file(path: str | None) -> str | None:
    """Config validator: the key file must exist and hold a usable key (read again at start)."""
    if path:
        ClusterKey.load(path)
    return path
