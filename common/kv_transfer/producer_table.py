"""The prefill node's one table of transfers: one record per request, one state, its moves.

The scheduler side of the producer connector (engine thread) and :class:`KVProducer` with
its control and sender threads share this table (the connector takes the transfer
engine's at ``bind``). Every state change is one of the methods below, made under the
table's ``lock`` (KVProducer holds it while it also queues the sends a change calls for).

| state        | entered by (thread)                                       | next                          |
|--------------|-----------------------------------------------------------|-------------------------------|
| RESERVED     | ``reserve``: admitted, nobody asked yet (HTTP)            | PULLED, HANDED_OVER, HELD, DROPPED; gone at its deadline |
| PULLED       | ``pulled``: the consumer asked before prefill finished (control, sender) | HANDED_OVER, HELD, DROPPED |
| HANDED_OVER  | ``hand_over``: first token sampled, blocks held (engine, scheduler) | HELD (``finish``), DROPPED |
| HELD         | ``finish``: prefill done; the lease runs (engine, worker) | SENDING, RELEASED             |
| SENDING      | ``sending``: pulled and finished, every layer and DONE queued | AWAITING_ACK (``done_sent``, sender), RELEASED |
| AWAITING_ACK | ``done_sent``; the lease runs again (``renew_acks``: while the consumer pings) | RELEASED (``ack``, abort, failure, lease) |
| RELEASED     | ``ack``, or ``drop`` of a finished request: blocks freeable | gone (``poll_freeable``), DROPPED if dropped |
| DROPPED      | ``drop`` (abort, failure, lease, discard): ``why`` kept to answer a late PULL | RELEASED (``finish``: its blocks) |

A dropped record stays (the newest ``MAX_DROPPED``) so a PULL that comes late is told why; so
does a released one whose id any decode node may pull (``kv_transfer_params``), so that a second
pull is told "already pulled" at once instead of waiting a lease for a prefill that never comes.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.engine.kv_connector import ConnectorState
from common.request_id import ANY_DECODE, parse_tags

if TYPE_CHECKING:
    from common.kv_transfer.sender import PairSender

S = ConnectorState
MAX_DROPPED = 10_000
ALREADY_PULLED = "KV already pulled (a kv_transfer_params transfer id is pulled once)"
FINISHED = (S.HELD, S.SENDING, S.AWAITING_ACK)  # prefill done: the record knows its blocks


@dataclass
class ProducerRequest:
    request_id: str
    deadline: float | None  # lease (reservation: its end); None while layers are being sent
    state: ConnectorState  # changed by ProducerTable only
    # first seen (the consumer's pull or prefill's finish): kv_transfer_seconds runs from here to the
    # ACK, as the consumer's runs from its request to the last layer
    created: float = field(default_factory=time.monotonic)
    link: PairSender | None = None
    # what the consumer wants: ``num_blocks`` blocks from ``first_block`` on (the consumer has
    # the ones before). Once both the pull and ``finish`` are in, ``block_ids`` starts there.
    num_blocks: int = 0
    first_block: int = 0
    first_token: int = 0
    first_logprobs: list = field(default_factory=list)  # [[token_id, logprob], ...] for DONE
    choices: list = field(default_factory=list)  # n > 1: DONE's ``choices``
    cached_tokens: int = 0  # DONE's ``cached_tokens``
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    remote_block_ids: list[int] = field(default_factory=list)  # the consumer's (cuda_ipc writes there)
    ready: object | None = None  # event after the prompt's last KV write (sends from the blocks order on it)
    queued_layers: set[int] = field(default_factory=set)
    nonce: int = 0  # the consumer's PULL's, echoed in DONE (verify.py)
    checksums: dict[int, int] = field(default_factory=dict)  # layer -> CRC-32 sent (checksummed pairs)
    reserved_blocks: int = 0  # RESERVED: what admission counted
    why: str | None = None  # dropped: the reason a late PULL is told

    @property
    def finished(self) -> bool:
        """Prefill is done: the request holds blocks of its own."""
        return self.state in FINISHED

    @property
    def dropped(self) -> bool:  # read by the sender thread without the lock: one attribute read
        return self.why is not None


class ProducerTable:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[str, ProducerRequest] = {}  # read under ``lock``; changed by the methods below
        self._num_dropped = 0

    def __len__(self) -> int:
        return len(self.records)

    def state(self, request_id: str) -> ConnectorState | None:
        with self.lock:
            req = self.records.get(request_id)
            return req.state if req is not None else None

    # ---- scheduler side (engine thread; takes the lock) ------------------------------------
    def hand_over(self, request_id: str) -> None:
        """Prefill sampled the first token: the scheduler holds the blocks until RELEASED."""
        with self.lock:
            req = self.records.get(request_id)
            if req is None:
                self.records[request_id] = ProducerRequest(request_id, None, S.HANDED_OVER)
            elif req.state is S.RESERVED:
                req.state, req.deadline = S.HANDED_OVER, None  # the lease starts at finish
            elif req.state is S.PULLED:
                req.state = S.HANDED_OVER  # the PULL's link and lease stay

    def forget(self, request_ids) -> None:
        """The scheduler freed these requests' blocks: their records go, if still there."""
        with self.lock:
            for rid in request_ids:
                req = self.records.get(rid)
                if req is not None and req.state in (S.HANDED_OVER, S.RELEASED):
                    del self.records[rid]

    # ---- transfer engine (the caller holds the lock) -----------------------------------------
    def reserve(self, request_id: str, num_blocks: int, limit_blocks: int, now: float, lease_s: float) -> bool:
        """RESERVED for ``lease_s`` if the blocks held for unclaimed requests (HELD, and RESERVED
        but not yet finished) stay within ``limit_blocks``; a request already asked for (or
        dropped) holds no unclaimed KV and is admitted as it is."""
        req = self.records.get(request_id)
        if req is not None and req.state is not S.RESERVED:
            return True
        for rid in [r for r, q in self.records.items() if q.state is S.RESERVED and q.deadline <= now]:
            del self.records[rid]  # admitted but never finished (the client left early)
        held = sum(len(q.block_ids) if q.state is S.HELD else q.reserved_blocks
                   for rid, q in self.records.items()
                   if rid != request_id and q.state in (S.HELD, S.RESERVED, S.HANDED_OVER))
        if held + num_blocks > limit_blocks:
            return False
        self.records[request_id] = ProducerRequest(request_id, now + lease_s, S.RESERVED, reserved_blocks=num_blocks)
        return True

    def pulled(self, request_id: str, deadline: float) -> ProducerRequest:
        """The record a PULL attaches to: a new PULLED one unless prefill already has one."""
        req = self.records.get(request_id)
        if req is None or req.state is S.RESERVED:
            req = self.records[request_id] = ProducerRequest(request_id, deadline, S.PULLED)
        req.reserved_blocks = 0  # claimed
        return req

    def finish(self, request_id: str, deadline: float) -> ProducerRequest | None:
        """Prefill finished: the record is HELD (the caller moves it on to SENDING if pulled);
        None (and RELEASED) when it was dropped meanwhile."""
        req = self.records.get(request_id)
        if req is not None and req.state is S.DROPPED:
            self._num_dropped -= 1
            req.state = S.RELEASED  # aborted or expired while prefill ran: only the blocks are left
            return None
        if req is None or req.state is S.RESERVED:
            req = self.records[request_id] = ProducerRequest(request_id, None, S.HELD)
        req.state, req.deadline, req.reserved_blocks = S.HELD, deadline, 0  # its real blocks count now
        return req

    def sending(self, req: ProducerRequest) -> None:
        req.state, req.deadline = S.SENDING, None

    def done_sent(self, req: ProducerRequest, deadline: float) -> None:
        if req.state is S.SENDING:  # not dropped meanwhile
            req.state, req.deadline = S.AWAITING_ACK, deadline

    def renew_acks(self, link: PairSender, deadline: float) -> None:
        """The consumer on ``link`` pinged: its AWAITING_ACK records' leases run until ``deadline``."""
        for req in self.records.values():
            if req.link is link and req.state is S.AWAITING_ACK:
                req.deadline = max(req.deadline or 0.0, deadline)

    def ack(self, request_id: str) -> ProducerRequest | None:
        req = self.records.get(request_id)
        if req is None or not req.finished:
            return None
        req.state, req.deadline = S.RELEASED, None
        return req

    def drop(self, request_id: str, why: str) -> ProducerRequest | None:
        """Aborted, failed or expired: RELEASED if it holds blocks (DROPPED once they are freed),
        else DROPPED now. Returns the record it had (None: none, or dropped already)."""
        req = self.records.get(request_id)
        if req is not None and (req.dropped or req.state is S.RELEASED):
            return None
        if req is not None and req.finished:
            req.state, req.why, req.deadline = S.RELEASED, why, None
            return req
        if req is not None:
            del self.records[request_id]  # to the end: the newest tombstones are kept
            req.state, req.why, req.deadline = S.DROPPED, why, None
        self._tombstone(ProducerRequest(request_id, None, S.DROPPED, why=why) if req is None else req)
        return req

    def poll_freeable(self) -> set[str]:
        out = {rid for rid, req in self.records.items() if req.state is S.RELEASED}
        for rid in out:
            req = self.records.pop(rid)
            if req.why is None and _any_decode(rid):  # a kv_transfer_params id is pulled once: say so after
                req.why = ALREADY_PULLED
            if req.why is not None:
                req.state = S.DROPPED
                self._tombstone(req)
        return out

    def _tombstone(self, req: ProducerRequest) -> None:
        self.records[req.request_id] = req
        self._num_dropped += 1
        if self._num_dropped > MAX_DROPPED:
            oldest = next(rid for rid, r in self.records.items() if r.state is S.DROPPED)
            del self.records[oldest]
            self._num_dropped -= 1


def _any_decode(request_id: str) -> bool:
    tags = parse_tags(request_id)
    return tags is not None and tags.decode_addr == ANY_DECODE
