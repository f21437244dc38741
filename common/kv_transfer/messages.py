"""Control-plane messages: typed, versioned, encoded and decoded in one place.

Every message is a msgpack map ``{"v": PROTOCOL_VERSION, "cmd": ..., "id": ..., **fields}``.
``id`` pairs a response with its request. Decoding rejects a wrong version, an unknown
``cmd`` or missing fields with :class:`MessageError`, so a listener can log and drop.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import msgpack

# 2: Handshake.backend/endpoint/ipc, HandshakeOk.backend, Pull.first_block/block_ids,
# Done.first_logprobs, sealed frames under a cluster key. A peer on another version is
# logged ("protocol version 2 != 3") and dropped: upgrade P and D together.
# 3: verified KV (verify.py): Pull.nonce; Done.nonce/num_layers/nbytes/checksums; Handshake.checksum,
# HandshakeOk.checksum.
# Still 3: FetchBlocks/Blocks (the peer tier) came later; only a node that says it serves them
# (its heartbeat's kv_peer_fetch) is asked, and any other drops the unknown command.
PROTOCOL_VERSION = 3
UNKNOWN_PAIR = "unknown or broken pair; handshake again"  # Error.reason a consumer acts on


class MessageError(ValueError):
    """A frame that is not a valid control message."""


@dataclass
class Message:
    CMD: ClassVar[str] = ""
    id: int = 0


@dataclass
class Handshake(Message):
    """Consumer -> producer: open a data-plane pair ``pair_id`` for this layout.

    ``backend`` is the consumer's ``--kv-transport`` (``auto`` or a transport), ``endpoint``
    its :class:`~common.kv_transfer.transport.Endpoint`; ``ipc`` its exported KV cache
    when it could take ``cuda_ipc`` (see cuda_ipc.py), else empty."""

    CMD: ClassVar[str] = "handshake"
    pair_id: str = ""
    layout: dict = field(default_factory=dict)
    backend: str = "auto"
    endpoint: dict = field(default_factory=dict)
    ipc: list = field(default_factory=list)
    checksum: str = "auto"  # the consumer's --kv-checksum (verify.py)
    consumer: str = ""  # the consumer's own KV address (host:port): keyless, what says it is a member


@dataclass
class HandshakeOk(Message):
    """Producer -> consumer: the pair uses ``backend`` (the producer's choice); join it at
    ``store_host:store_port`` as rank 1 (cuda_ipc: nothing to join)."""

    CMD: ClassVar[str] = "handshake_ok"
    pair_id: str = ""
    store_host: str = ""
    store_port: int = 0
    backend: str = ""
    checksum: bool = False  # DONE carries per-layer checksums on this pair (verify.use_checksum)


@dataclass
class Pull(Message):
    """Consumer -> producer: send ``request_id``'s KV over ``pair_id``: blocks ``first_block`` to
    ``num_blocks`` (the prompt's count) of each layer. The consumer already holds the blocks
    before ``first_block`` (its prefix cache); 0, the default, asks for everything.
    ``block_ids``: the consumer's blocks from ``first_block`` on, which a cuda_ipc producer
    writes into."""

    CMD: ClassVar[str] = "pull"
    request_id: str = ""
    pair_id: str = ""
    num_blocks: int = 0
    num_tokens: int = 0
    block_ids: list = field(default_factory=list)
    first_block: int = 0
    nonce: int = 0  # the consumer's id of this transfer; DONE echoes it (verify.py)


@dataclass
class Ok(Message):
    CMD: ClassVar[str] = "ok"


@dataclass
class Error(Message):
    CMD: ClassVar[str] = "error"
    reason: str = ""
    request_id: str = ""


@dataclass
class LayerNotice(Message):
    """Producer -> consumer: the next tensor(s) on the pair hold these layers (metadata out
    of band). ``shape`` is one layer's ``[2, blocks, block_size, heads, head_dim]``.

    ``parts`` = 1: one tensor ``[len(layers), *shape]`` (several layers coalesced so each
    message is big enough to be efficient); 2: one layer as keys then values, each
    ``shape[1:]`` (sent straight from a contiguous run of blocks, no gather).
    """

    CMD: ClassVar[str] = "layer"
    request_id: str = ""
    pair_id: str = ""
    layers: list = field(default_factory=list)
    dtype: str = ""
    shape: list = field(default_factory=list)
    parts: int = 1


@dataclass
class Done(Message):
    """Producer -> consumer: every layer of ``request_id`` was sent; here is the first token
    and, when the request asked for logprobs, its ``[[token_id, logprob], ...]`` (chosen and
    top-n, as the prefill node's sampler reported them; empty otherwise). ``choices``: a request
    with n > 1 choices sends choices 1..n-1's first tokens, ``[[token_id, logprobs], ...]``
    (logprobs as above); the decode node forks them from the one transferred prompt."""

    CMD: ClassVar[str] = "done"
    request_id: str = ""
    pair_id: str = ""
    first_token: int = 0
    first_logprobs: list = field(default_factory=list)
    choices: list = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens the producer found in its prefix cache (usage's cached_tokens)
    # what the consumer checks before it uses the KV (verify.py): PULL's nonce, the layers and
    # bytes the producer sent, and (when the pair checksums) each layer's CRC-32, by layer
    nonce: int = 0
    num_layers: int = 0
    nbytes: int = 0
    checksums: list = field(default_factory=list)


@dataclass
class Ack(Message):
    """Consumer -> producer: KV landed; the producer may free the blocks."""

    CMD: ClassVar[str] = "ack"
    request_id: str = ""


@dataclass
class Abort(Message):
    """Consumer -> producer: stop and drop ``request_id``."""

    CMD: ClassVar[str] = "abort"
    request_id: str = ""


@dataclass
class Ping(Message):
    """Consumer -> producer, every ``heartbeat_s`` while it holds pair ``pair_id`` (or waits
    on one): both sides learn the other is alive."""

    CMD: ClassVar[str] = "ping"
    pair_id: str = ""


@dataclass
class FetchBlocks(Message):
    """Any node -> a peer, outside any request (the peer tier, peer_fetch.py): send the KV of the
    leading blocks of ``hashes`` (prefix-cache block hashes, in chain order) that you hold, for a KV
    layout of ``fingerprint``. Answered by :class:`Blocks` or :class:`Error`."""

    CMD: ClassVar[str] = "fetch_blocks"
    hashes: list = field(default_factory=list)
    fingerprint: str = ""


@dataclass
class Blocks(Message):
    """Peer -> fetcher: the KV of the first ``count`` blocks asked (every layer's K and V of a block,
    ``[layers, 2, block_size, kv_heads, head_dim]``, block after block) and each block's CRC-32."""

    CMD: ClassVar[str] = "blocks"
    count: int = 0
    data: bytes = b""
    checksums: list = field(default_factory=list)


MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.CMD: cls
    for cls in (Handshake, HandshakeOk, Pull, Ok, Error, LayerNotice, Done, Ack, Abort, Ping, FetchBlocks, Blocks)
}


# fields a peer from before they existed does not send
# (verify.py's fields: a DONE without them decodes, then fails the consumer's checks)
_OPTIONAL: dict[str, tuple[str, ...]] = {Pull.CMD: ("first_block", "nonce"), Ping.CMD: ("pair_id",),
                                          Done.CMD: ("choices", "cached_tokens", "nonce", "num_layers", "nbytes",
                                                     "checksums"),
                                          Handshake.CMD: ("checksum", "consumer"), HandshakeOk.CMD: ("checksum",)}


_FIELD_NAMES: dict[type[Message], tuple[str, ...]] = {cls: tuple(f.name for f in fields(cls))
                                                     for cls in MESSAGE_TYPES.values()}
# each field's wire type, from its default: int, str, list or dict
_FIELD_TYPES: dict[type[Message], dict[str, type]] = {
    cls: {f.name: type(f.default_factory() if callable(f.default_factory) else f.default) for f in fields(cls)}
    for cls in MESSAGE_TYPES.values()}


def encode(msg: Message) -> bytes:
    # the fields as they are (``dataclasses.asdict`` deep-copies every list: 240 µs for a PULL
    # of 256 block ids, on the path of every transfer)
    body = {name: getattr(msg, name) for name in _FIELD_NAMES[type(msg)]}
    return msgpack.packb({"v": PROTOCOL_VERSION, "cmd": msg.CMD, **body}, use_bin_type=True)


def decode(frame: bytes) -> Message:
    """Parse one frame; raise :class:`MessageError` on anything but a known, valid message."""
    try:
        raw: Any = msgpack.unpackb(frame, raw=False)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise MessageError(f"not msgpack: {e}") from e
    if not isinstance(raw, dict):
        raise MessageError(f"not a map: {type(raw).__name__}")
    if raw.get("v") != PROTOCOL_VERSION:
        raise MessageError(f"protocol version {raw.get('v')!r} != {PROTOCOL_VERSION}")
    cls = MESSAGE_TYPES.get(raw.get("cmd"))  # type: ignore[arg-type]
    if cls is None:
        raise MessageError(f"unknown cmd {raw.get('cmd')!r}")
    kwargs = {}
    for name, kind in _FIELD_TYPES[cls].items():
        if name in _OPTIONAL.get(cls.CMD, ()) and name not in raw:
            continue  # added later with a default that keeps the old meaning
        if name not in raw:
            raise MessageError(f"{cls.CMD}: missing field {name!r}")
        value = raw[name]
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise MessageError(f"{cls.CMD}: field {name!r} is {type(value).__name__}, not {kind.__name__}")
        kwargs[name] = value
    return cls(**kwargs)
