"""The consumer's half of building a pair: the control-plane handshake, then the data plane.

The consumer proposes (pair id, KV layout, its transport mode and device, on CUDA the
exported IPC handles of its cache, its checksum wish); the producer checks the layout,
chooses the transport and answers with where to connect (producer.py ``_on_handshake``).
The handshake is bounded by ``handshake_timeout_s``, building the pair after it by
``connect_timeout_s``.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from common.kv_layout import KVLayout
from common.kv_transfer.config import ConnectionReopened, NoPairError, TransferConfig, TransferError
from common.kv_transfer.cuda_ipc import export_cache
from common.kv_transfer.messages import Error, Handshake, HandshakeOk
from common.kv_transfer.transport import Endpoint, open_pair

if TYPE_CHECKING:
    from common.kv_transfer.control import ControlPlane


@dataclass
class OpenedPair:
    pair: object  # PairGroup | TcpPair | IpcPair
    pair_id: str
    transport: str
    checksum: bool  # the pair's DONEs carry per-layer checksums
    exported: list[int]  # data pointers of the KV cache a cuda_ipc handshake exported


def open_consumer_pair(control: ControlPlane, address: str, layout: KVLayout, mode: str,
                       config: TransferConfig, kv_caches: list[torch.Tensor], consumer: str = "") -> OpenedPair:
    """Handshake with the producer at ``address`` and build the pair (rank 1); TransferError
    naming the producer when either fails, :class:`NoPairError` when the producer refused.
    ``consumer``: this side's own KV address, which keyless producers check for membership."""
    pair_id, device = uuid.uuid4().hex, kv_caches[0].device
    could_ipc = device.type == "cuda" and mode in ("auto", "cuda_ipc")
    ipc = export_cache(kv_caches) if could_ipc else []
    hello = Handshake(pair_id=pair_id, layout=layout.to_dict(), backend=mode,
                      endpoint=Endpoint.local(device).to_dict(), ipc=ipc, checksum=config.checksum,
                      consumer=consumer)
    deadline = time.monotonic() + config.handshake_timeout_s
    while True:
        fut = control.request(address, hello, max(deadline - time.monotonic(), 0.1))
        try:
            reply = fut.result(timeout=config.handshake_timeout_s + 1)
            break
        except ConnectionReopened:  # lost with a stuck connection the control plane replaced: again,
            hello.pair_id = pair_id = uuid.uuid4().hex  # under a new id (the producer may have seen it)
            if time.monotonic() >= deadline:
                raise TransferError(f"producer {address} unreachable: no answer before the deadline") from None
        except Exception as e:
            raise TransferError(f"producer {address} unreachable: {e}") from e
    if isinstance(reply, Error):  # nothing asked for yet, nothing lands: the decode node may compute it
        raise NoPairError("pairs_full" if "--kv-max-pairs" in reply.reason else "pair_refused",
                          f"producer {address} refused a pair: {reply.reason}")
    if not isinstance(reply, HandshakeOk):
        raise TransferError(f"unexpected handshake reply {reply.CMD}")
    try:
        pair = open_pair(reply.backend, 1, config.timeout_s, pair_id, connect_timeout_s=config.connect_timeout_s,
                         host=reply.store_host, port=reply.store_port, device=str(device), key=control.key)
    except TransferError as e:  # the client's error must say which peer went away
        raise TransferError(f"data plane to producer {address} failed: {e}") from e
    return OpenedPair(pair, pair_id, reply.backend, reply.checksum, [x.data_ptr() for x in kv_caches])
