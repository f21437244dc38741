"""KV events on the wire: vLLM's layout and framing, plus the cluster key's seal.

A daemon tells whoever subscribes what its prefix cache holds (``common/engine/cache_events.py``),
in the layout of vLLM's ``vllm/distributed/kv_events.py``, so an indexer written for vLLM reads
ours. A batch is the msgpack array ``[ts, [event, ...]]`` (vLLM's ``KVEventBatch``, fields in
order, ``data_parallel_rank`` left out as vLLM's ``omit_defaults`` does); an event is a tagged
array, the class name first and then its fields in order::

    ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium, lora_name]
    ["BlockRemoved", block_hashes, medium]
    ["AllBlocksCleared"]

Block hashes are our 16-byte chain hashes (vLLM's ``ExternalBlockHash`` is ``bytes | int``);
``lora_id`` and ``lora_name`` are always nil. ``medium`` says where the block is: nil for the KV
pool on the device (vLLM writes "GPU", which a decoder reads the same), "CPU" or "DISK" for a
KV tier behind it (common/engine/kv_tiers.py; vLLM's offloading connector names its CPU tier "CPU"). ``lora_name`` is the field vLLM added
last without a default: its decoders read the seven, older ones (six fields) ignore a trailing
one as msgspec's ``array_like`` does, and fields added since have defaults.

Framing (vLLM's): the PUB socket sends ``[topic, seq, payload]``, ``seq`` an 8-byte big-endian
count, one per batch; the replay ROUTER takes ``[b"", start_seq]`` from a DEALER and answers
``[b"", seq, payload]`` for each batch from ``start_seq`` on, then ``[b"", END_SEQ, b""]``.
Under a cluster key every message gains one last frame, a seal (common.cluster_auth) over
``seq + payload`` (a replay request's over ``start_seq``): a subscriber drops an unsealed or
badly sealed message, and a publisher answers no unsealed replay request. Keyless the wire is
vLLM's exactly.

Decoding is for the proxy, which reads what anyone who reaches a daemon's port could send:
:func:`decode_batch` bounds sizes and types and raises :class:`EventFormatError`, never more.
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass

import msgpack

from common.cluster_auth import Sealer

END_SEQ = struct.pack(">q", -1)
MAX_PAYLOAD_BYTES = 8 << 20  # a snapshot of 200,000 cached blocks is ~4 MB
MAX_EVENTS = 100_000  # per batch
MAX_HASHES = 500_000  # per event (a snapshot names every cached block in one)
MAX_HASH_BYTES = 64


class EventFormatError(ValueError):
    """A batch or frame that is not KV events in our layout."""


DEVICE_MEDIUMS = (None, "GPU", "cuda", "gpu")  # the KV pool itself
TIER_MEDIUMS = ("CPU", "DISK")


@dataclass(frozen=True)
class Stored:
    block_hashes: tuple[bytes, ...]
    medium: str | None = None  # None: the device pool; else one of TIER_MEDIUMS


@dataclass(frozen=True)
class Removed:
    block_hashes: tuple[bytes, ...]
    medium: str | None = None


@dataclass(frozen=True)
class Cleared:
    pass


WireEvent = Stored | Removed | Cleared


def encode_event(event: object) -> list:
    """One ``cache_events`` event as vLLM's tagged array."""
    kind = type(event).__name__
    if kind == "BlockStored":
        return [kind, list(event.block_hashes), event.parent_block_hash, list(event.token_ids),  # type: ignore[attr-defined]
                event.block_size, None, event.medium, None]  # type: ignore[attr-defined]
    if kind == "BlockRemoved":
        return [kind, list(event.block_hashes), event.medium]  # type: ignore[attr-defined]
    if kind == "AllBlocksCleared":
        return [kind]
    raise TypeError(f"not a cache event: {kind}")


def encode_batch(events: list[list], ts: float | None = None) -> bytes:
    """``[ts, events]`` (events already tagged arrays) as msgpack."""
    return msgpack.packb([time.time() if ts is None else ts, events], use_bin_type=True)


def snapshot_batch(hashes: list[bytes], block_size: int) -> bytes:
    """The whole cache as one batch: cleared, then every cached hash stored (no tokens, no parent:
    what a subscriber too far behind for the replay buffer rebuilds from)."""
    return encode_batch([["AllBlocksCleared"], ["BlockStored", hashes, None, [], block_size, None, None, None]])


def decode_batch(payload: bytes) -> list[WireEvent]:
    """A batch's events, each checked; raises EventFormatError."""
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise EventFormatError(f"batch of {len(payload)} bytes")
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=True, max_array_len=MAX_HASHES,
                                max_map_len=64, max_str_len=1024, max_bin_len=MAX_HASH_BYTES, max_ext_len=0)
    except Exception as exc:  # noqa: BLE001 - msgpack raises several unrelated types on garbage
        raise EventFormatError(f"not msgpack: {type(exc).__name__}") from None
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise EventFormatError("a batch is [ts, [events]]")
    if len(batch[1]) > MAX_EVENTS:
        raise EventFormatError(f"{len(batch[1])} events in one batch")
    return [_event(e) for e in batch[1]]


def _event(raw: object) -> WireEvent:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise EventFormatError("an event is a tagged array")
    tag = raw[0]
    if tag == "AllBlocksCleared":
        return Cleared()
    if tag in ("BlockStored", "BlockRemoved") and len(raw) >= 2:
        hashes = raw[1]
        if not isinstance(hashes, list) or not all(isinstance(h, bytes) and h for h in hashes):
            raise EventFormatError(f"{tag}: block_hashes must be a list of non-empty byte strings")
        medium = _medium(raw[6] if tag == "BlockStored" and len(raw) > 6 else raw[2] if tag == "BlockRemoved"
                         and len(raw) > 2 else None)
        return Stored(tuple(hashes), medium) if tag == "BlockStored" else Removed(tuple(hashes), medium)
    raise EventFormatError(f"unknown event {tag[:40]!r}")


def _medium(raw: object) -> str | None:
    """None for the device pool, else the medium named (another engine's own names pass: the index
    keeps only TIER_MEDIUMS); EventFormatError for a non-string."""
    if raw in DEVICE_MEDIUMS:
        return None
    if not isinstance(raw, str) or len(raw) > 32:
        raise EventFormatError("medium must be nil or a short string")
    return raw


def seq_bytes(seq: int) -> bytes:
    return struct.pack(">q", seq)


def read_seq(frame: bytes) -> int:
    if len(frame) != 8:
        raise EventFormatError(f"sequence frame of {len(frame)} bytes")
    return struct.unpack(">q", frame)[0]


def seal_frames(sealer: Sealer, frames: list[bytes], covered: bytes) -> list[bytes]:
    """``frames`` plus, under a key, the seal over ``covered``."""
    return frames + sealer.frames(covered)[1:]


def open_frames(sealer: Sealer, frames: list[bytes], count: int, covered: slice) -> str | None:
    """None when ``frames`` (``count`` of them before any seal) are acceptable under ``sealer``'s
    key, else why not (a metric label). ``covered``: the frames the seal covers, joined."""
    want = count + (sealer.key is not None)
    if len(frames) != want:
        return "frame_count"
    if sealer.key is None:
        return None
    _, reason = sealer.open([b"".join(frames[covered]), frames[-1]])
    return reason
