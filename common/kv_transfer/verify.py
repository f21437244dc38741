"""Verified KV: decode never runs on KV that is partial, stale or from another request.

The consumer picks a random ``nonce`` per transfer and sends it in its PULL; the producer
echoes it in DONE together with the layer count, the byte count it meant to send and, when
the pair checksums, a CRC-32 per layer over the bytes it sent (in the consumer's order:
keys then values, blocks in prompt order). The consumer computes the same over what landed
in its blocks and checks everything in :func:`check_done_identity` before the request is
reported landed. A mismatch fails the request (the proxy may migrate it) and is counted by
reason (``pdserve:kv_transfer_rejected_total{reason}``).

Checksums cost: zlib.crc32 runs at ~2.2 GB/s a core on the dev box (memcpy ~12.6 GB/s,
loopback TCP ~3 GB/s), once on each side, so it is switchable (``--kv-checksum``). ``auto``
checksums ``tcp`` pairs only: on ``gloo``/``nccl``/``cuda_ipc`` the bytes are in staging
buffers or GPU memory, where a checksum needs a kernel or a device-to-host copy; those
pairs still check identity, layer and byte counts.
"""

from __future__ import annotations

import secrets
import zlib

import torch

from common.kv_layout import KVLayout
from common.kv_transfer.messages import Done
from common.kv_transfer.paged import block_runs, gather_blocks
from common.kv_transfer.tcp_pair import layer_buffers, tensor_buffer

CHECKSUM_MODES = ("auto", "on", "off")

# reasons (the metric's label values)
NOT_REQUESTED = "not_requested"  # a DONE for a request this consumer does not wait for
STALE = "stale"  # a DONE for an earlier transfer of the same request id (nonce differs)
LAYERS = "layers"  # layers missing, or a layer count that is not the layout's
BYTES = "bytes"  # fewer or more bytes landed than the request's blocks hold
CHECKSUM = "checksum"  # a layer's bytes differ from what the producer sent
REASONS = (NOT_REQUESTED, STALE, LAYERS, BYTES, CHECKSUM)


class KVRejected(Exception):
    """Landed KV that must not be used; ``reason`` is one of :data:`REASONS`."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


def new_nonce() -> int:
    return secrets.randbits(63) | 1  # never 0: 0 is what an old peer's message decodes to


def use_checksum(consumer_mode: str, producer_mode: str, transport: str = "tcp") -> bool:
    """Whether a pair checksums: ``off`` on either side wins, then ``on`` on either side. ``auto``
    is off on every transport today: CRC-32 quadrupled a loopback tcp transfer's time (64 MiB:
    20 -> 81 ms) and tcp already checksums its segments; the GPU transports would need a kernel.
    A ``cuda_ipc`` pair never does (the producer copies into the consumer's blocks on the GPU:
    neither side has the bytes to hash), whatever was asked: it checks nonce, layers and bytes."""
    modes = {consumer_mode, producer_mode}
    return "off" not in modes and "on" in modes and transport != "cuda_ipc"


def layer_checksum(buffers: list[memoryview], crc: int = 0) -> int:
    """CRC-32 of the concatenation of ``buffers`` (how they are split does not matter)."""
    for buf in buffers:
        crc = zlib.crc32(buf, crc)
    return crc


def blocks_checksum(kv: torch.Tensor, block_ids: list[int]) -> int:
    """CRC-32 of ``kv[:, block_ids]`` in the wire's order (keys, then values, block by block): read
    in place from a contiguous CPU cache, else (a head slice of the cache, a GPU tensor) from a
    gathered host copy, held while the CRC reads it (``tensor_buffer`` keeps no reference)."""
    if kv.is_contiguous() and kv.device.type == "cpu":
        return layer_checksum(layer_buffers(kv, block_runs(block_ids)))
    host = gather_blocks(kv, block_ids).cpu()
    return layer_checksum([tensor_buffer(host)])


def expected_nbytes(layout: KVLayout, num_blocks: int) -> int:
    """Bytes of every layer of ``num_blocks`` blocks: what a whole transfer carries."""
    return layout.num_layers * num_blocks * layout.bytes_per_block_per_layer()


def check_done_identity(msg: Done, *, nonce: int, layout: KVLayout, num_blocks: int, layers: set[int],
                        nbytes: int, checksums: dict[int, int] | None) -> None:
    """Raise :class:`KVRejected` unless ``msg`` closes this transfer and its KV landed whole:
    ``layers`` and ``nbytes`` are what landed for ``num_blocks`` blocks, ``checksums`` (layer ->
    CRC-32 of what landed) is None when the pair does not checksum."""
    if msg.nonce != nonce:
        raise KVRejected(STALE, f"DONE for another transfer of {msg.request_id} (nonce differs)")
    want = expected_nbytes(layout, num_blocks)
    if msg.num_layers != layout.num_layers or len(layers) != layout.num_layers:
        raise KVRejected(LAYERS, f"{len(layers)} layers landed, DONE says {msg.num_layers}, "
                                 f"the layout has {layout.num_layers}")
    if not nbytes == msg.nbytes == want:
        raise KVRejected(BYTES, f"{nbytes} bytes landed, DONE says {msg.nbytes}, {num_blocks} blocks hold {want}")
    if checksums is None:
        return
    if len(msg.checksums) != layout.num_layers:
        raise KVRejected(CHECKSUM, f"DONE carries {len(msg.checksums)} layer checksums, not {layout.num_layers}")
    bad = [layer for layer in range(layout.num_layers) if checksums.get(layer) != msg.checksums[layer]]
    if bad:
        raise KVRejected(CHECKSUM, f"layers {bad} differ from what the producer sent (checksum)")


def tensor_checksum(t: torch.Tensor, crc: int = 0) -> int:
    """CRC-32 of a contiguous CPU tensor's bytes."""
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy(), crc)
