"""The prefill node's one table of transfers: one record per request, one state, its moves.

The scheduler side of the producer connector (engine thread) and :class:`KVProducer` with
its I/O thread shares this table (the connector takes the transfer
engine's at ``bind``). The table writes every field of its records, under its ``lock``
(KVProducer holds it while it also queues the sends a change calls for): the other threads
report what happened (a method below) and read. A state changes only through
:meth:`ProducerTable._move`, along :data:`MOVES`; any other move is a bug and raises
:class:`~common.kv_transfer.consumer_table.IllegalMove`.

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

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.kv_transfer.consumer_table import IllegalMove
from common.request_id import ANY_DECODE, parse_tags

if TYPE_CHECKING:
    from common.kv_transfer.sender import PairSender


class ProducerState(enum.Enum):
    """Where one transfer is on the prefill node (the table above)."""

    RESERVED = "reserved"  # admitted while nobody asked for its KV: counted against the unclaimed limit
    PULLED = "pulled"  # the consumer asked before prefill finished; no byte moved yet
    HANDED_OVER = "handed_over"  # scheduler: first token sampled, blocks held; the hand-over is on its way
    HELD = "held"  # prefill finished: KV waits in the blocks under a lease (sent once pulled)
    SENDING = "sending"  # pulled and finished: every layer and DONE queued on the pair
    AWAITING_ACK = "awaiting_ack"  # DONE sent; freed on ACK, or when the lease ends
    RELEASED = "released"  # the blocks may be freed: waits for a poll
    DROPPED = "dropped"  # aborted, failed or expired; kept a while to answer a late PULL


S = ProducerState
# every move a record may make (a record is new before its first state, gone after its last)
MOVES: dict[ProducerState | None, frozenset[ProducerState]] = {
    None: frozenset({S.RESERVED, S.PULLED, S.HANDED_OVER, S.HELD, S.DROPPED}),
    S.RESERVED: frozenset({S.PULLED, S.HANDED_OVER, S.HELD, S.DROPPED}),
    S.PULLED: frozenset({S.HANDED_OVER, S.HELD, S.DROPPED}),
    S.HANDED_OVER: frozenset({S.HELD, S.DROPPED}),
    S.HELD: frozenset({S.HELD, S.SENDING, S.RELEASED}),
    S.SENDING: frozenset({S.AWAITING_ACK, S.RELEASED}),
    S.AWAITING_ACK: frozenset({S.RELEASED}),
    S.RELEASED: frozenset({S.DROPPED}),
    S.DROPPED: frozenset({S.RELEASED}),
}
MAX_DROPPED = 10_000
ALREADY_PULLED = "KV already pulled (a kv_transfer_params transfer id is pulled once)"
FINISHED = (S.HELD, S.SENDING, S.AWAITING_ACK)  # prefill done: the record knows its blocks


@dataclass
class ProducerRequest:
    request_id: str
    deadline: float | None = None  # lease (reservation: its end); None while layers are being sent
    state: ProducerState | None = None  # moved by ProducerTable only
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
    def dropped(self) -> bool:  # read by the I/O thread without the lock: one attribute read
        return self.why is not None


class ProducerTable:
    """The prefill node's records, by request id; every field of a record is written here."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: dict[str, ProducerRequest] = {}  # read under ``lock``; changed by the methods below
        self._num_dropped = 0

    def __len__(self) -> int:
        return len(self.records)

    def state(self, request_id: str) -> ProducerState | None:
        with self.lock:
            req = self.records.get(request_id)
            return req.state if req is not None else None

    @staticmethod
    def _move(req: ProducerRequest, to: ProducerState, deadline: float | None = None) -> None:
        """The one place a state changes (lock held); every move sets the lease anew."""
        if to not in MOVES[req.state]:
            raise IllegalMove(f"transfer {req.request_id}: {req.state and req.state.name} -> {to.name}")
        req.state, req.deadline = to, deadline

    def _new(self, request_id: str, to: ProducerState, deadline: float | None = None) -> ProducerRequest:
        req = self.records[request_id] = ProducerRequest(request_id)
        self._move(req, to, deadline)
        return req

    # ---- scheduler side (engine thread; takes the lock) ------------------------------------
    def hand_over(self, request_id: str) -> None:
        """Prefill sampled the first token: the scheduler holds the blocks until RELEASED."""
        with self.lock:
            req = self.records.get(request_id)
            if req is None:
                self._new(request_id, S.HANDED_OVER)
            elif req.state is S.RESERVED:
                self._move(req, S.HANDED_OVER)  # the lease starts at finish
            elif req.state is S.PULLED:
                self._move(req, S.HANDED_OVER, req.deadline)  # the PULL's link and lease stay

    def forget(self, request_ids) -> None:
        """The scheduler freed these requests' blocks: their records go, if still there."""
        with self.lock:
            for rid in request_ids:
                req = self.records.get(rid)
                if req is not None and req.state in (S.HANDED_OVER, S.RELEASED):
                    del self.records[rid]

    # ---- KV endpoint (the caller holds the lock) -----------------------------------------
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
        if request_id in self.records:
            del self.records[request_id]  # reserved again: counted anew
        self._new(request_id, S.RESERVED, now + lease_s).reserved_blocks = num_blocks
        return True

    def pulled(self, request_id: str, deadline: float, link: PairSender, block_ids: list[int],
               num_blocks: int, first_block: int, nonce: int) -> ProducerRequest:
        """A PULL attaches ``link`` and what the consumer wants (``num_blocks`` prompt blocks from
        ``first_block`` on, into its ``block_ids``) to the record: a PULLED one unless prefill
        already made one (a reservation is claimed)."""
        req = self.records.get(request_id)
        if req is None:
            req = self._new(request_id, S.PULLED, deadline)
        elif req.state is S.RESERVED:
            self._move(req, S.PULLED, deadline)
        req.reserved_blocks = 0  # claimed
        req.link, req.remote_block_ids, req.first_block = link, list(block_ids), first_block
        req.nonce, req.num_blocks = nonce, num_blocks - first_block
        if req.finished:
            req.block_ids = req.block_ids[first_block:]
        return req

    def finish(self, request_id: str, deadline: float, *, first_token: int, first_logprobs: list,
               choices: list, cached_tokens: int, kv_caches: list[torch.Tensor], block_ids: list[int],
               ready: object | None) -> ProducerRequest | None:
        """Prefill finished with these results: the record is HELD (the caller moves it on to
        SENDING if pulled); None (and RELEASED) when it was dropped meanwhile."""
        req = self.records.get(request_id)
        if req is not None and req.state is S.DROPPED:
            self._num_dropped -= 1
            self._move(req, S.RELEASED)  # aborted or expired while prefill ran: only the blocks are left
            return None
        if req is None:
            req = self._new(request_id, S.HELD, deadline)
        else:
            self._move(req, S.HELD, deadline)
        req.reserved_blocks = 0  # its real blocks count now
        req.first_token, req.first_logprobs, req.choices = first_token, first_logprobs, choices
        req.cached_tokens, req.kv_caches, req.ready = cached_tokens, kv_caches, ready
        req.block_ids = list(block_ids)[req.first_block:]
        return req

    def queue(self, req: ProducerRequest, layers) -> None:
        """``layers`` of ``req`` are queued for its pair's sender."""
        req.queued_layers.update(layers)

    def sending(self, req: ProducerRequest) -> None:
        self._move(req, S.SENDING)

    def checksummed(self, req: ProducerRequest, checksums: dict[int, int]) -> None:
        """The sender computed these layers' CRC-32s (I/O thread: takes the lock)."""
        with self.lock:
            req.checksums.update(checksums)

    def done_sent(self, req: ProducerRequest, deadline: float) -> None:
        if req.state is S.SENDING:  # not dropped meanwhile
            self._move(req, S.AWAITING_ACK, deadline)

    def renew_acks(self, link: PairSender, deadline: float) -> None:
        """The consumer on ``link`` pinged: its AWAITING_ACK records' leases run until ``deadline``."""
        for req in self.records.values():
            if req.link is link and req.state is S.AWAITING_ACK:
                req.deadline = max(req.deadline or 0.0, deadline)

    def ack(self, request_id: str) -> ProducerRequest | None:
        req = self.records.get(request_id)
        if req is None or not req.finished:
            return None
        self._move(req, S.RELEASED)
        return req

    def drop(self, request_id: str, why: str) -> ProducerRequest | None:
        """Aborted, failed or expired: RELEASED if it holds blocks (DROPPED once they are freed),
        else DROPPED now. Returns the record it had (None: none, or dropped already)."""
        req = self.records.get(request_id)
        if req is not None and (req.dropped or req.state is S.RELEASED):
            return None
        if req is not None and req.finished:
            self._move(req, S.RELEASED)
            req.why = why
            return req
        if req is None:
            self._tombstone(self._new(request_id, S.DROPPED), why)
            return None
        del self.records[request_id]  # to the end: the newest tombstones are kept
        self._move(req, S.DROPPED)
        self._tombstone(req, why)
        return req

    def poll_freeable(self) -> set[str]:
        out = {rid for rid, req in self.records.items() if req.state is S.RELEASED}
        for rid in out:
            req = self.records.pop(rid)
            why = req.why
            if why is None and _any_decode(rid):  # a kv_transfer_params id is pulled once: say so after
                why = ALREADY_PULLED
            if why is not None:
                self._move(req, S.DROPPED)
                self._tombstone(req, why)
        return out

    def _tombstone(self, req: ProducerRequest, why: str) -> None:
        req.why = why
        self.records[req.request_id] = req
        self._num_dropped += 1
        if self._num_dropped > MAX_DROPPED:
            oldest = next(rid for rid, r in self.records.items() if r.state is S.DROPPED)
            del self.records[oldest]
            self._num_dropped -= 1


def _any_decode(request_id: str) -> bool:
    tags = parse_tags(request_id)
    return tags is not None and tags.decode_addr == ANY_DECODE
