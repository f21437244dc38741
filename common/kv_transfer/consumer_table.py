"""The decode node's one table of transfers: one record per request, one state, its moves.

The scheduler side of the consumer connector (engine thread) and :class:`KVConsumer` with
its I/O thread shares this table (the connector takes the KV endpoint's at ``bind``).
The table writes every field of its records, under its lock: the other threads report what
happened (a method below) and read. A state changes only through :meth:`ConsumerTable._move`,
along :data:`MOVES`; any other move is a bug and raises :class:`IllegalMove`. The I/O thread
keeps references to the records it works on, never copies of their state.

| state        | entered by (thread)                                  | next                            |
|--------------|------------------------------------------------------|---------------------------------|
| LOAD_PENDING | ``load_pending``: blocks allocated (engine, scheduler)       | LOADING; gone (``cancel_pending``)      |
| LOADING      | ``issue``: the load is in the metadata (engine)      | QUEUED, FAILED; ABORTING, STOPPED |
| QUEUED       | ``start``: ``KVConsumer.request`` (engine, worker)   | PULLED, FAILED; ABORTING        |
| PULLED       | ``pull_sent`` (link)                                 | RECEIVING, LANDED, FAILED; ABORTING |
| RECEIVING    | ``layers_landed`` (link)                             | LANDED, FAILED; ABORTING        |
| LANDED       | ``finish``: DONE checked (link)                      | REPORTED (``poll_finished``); STOPPED (``stop``) |
| REPORTED     | ``poll_finished`` (engine)                           | gone (``take_landed``, next poll); STOPPED |
| FAILED       | ``finish`` (link), or ``start`` of a refused request | gone (``poll_finished``); STOPPED (``stop``) |
| ABORTING     | ``abort`` (scheduler) or ``stop`` (worker) of a load that may still land (engine) | STOPPED (``abort_stopped``, link) |
| STOPPED      | ``abort_stopped`` (link); ``stop`` of one nothing writes into | gone (``poll_aborted``)  |

ABORTING wins every race: a landing or a failure after it is ignored, and the blocks stay
held until the link says it stopped.
"""

from __future__ import annotations

import enum
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.kv_transfer.verify import new_nonce

if TYPE_CHECKING:
    from common.kv_transfer.receiver import PairReceiver


class IllegalMove(AssertionError):
    """A record asked to make a move its table does not allow: a bug, never a peer's doing."""


class ConsumerState(enum.Enum):
    """Where one transfer is on the decode node (the table above)."""

    LOAD_PENDING = "load_pending"  # scheduler: blocks allocated; the load goes out with the next metadata
    LOADING = "loading"  # scheduler: the load is in the step's metadata, on its way to the KV endpoint
    QUEUED = "queued"  # handed to the I/O thread; handshake (if no pair yet) and PULL next
    PULLED = "pulled"  # the PULL is out; no byte landed yet
    RECEIVING = "receiving"  # layers landing in the blocks; DONE finishes it
    LANDED = "landed"  # every layer and DONE in and checked: the first token waits for a poll
    REPORTED = "reported"  # polled; DONE's logprobs, choices and cached count wait to be taken
    FAILED = "failed"  # ended with an error that waits for a poll
    ABORTING = "aborting"  # aborted while KV may still land in the blocks (held)
    STOPPED = "stopped"  # aborted, nothing writes into the blocks any more: waits for a poll

    @property
    def receiving(self) -> bool:
        """The load is out and KV may still land in its blocks."""
        return self in (S.LOADING, S.QUEUED, S.PULLED, S.RECEIVING)


S = ConsumerState
# every move a record may make (a record is new before its first state, gone after its last)
MOVES: dict[ConsumerState | None, frozenset[ConsumerState]] = {
    None: frozenset({S.LOAD_PENDING, S.QUEUED, S.FAILED, S.STOPPED}),
    S.LOAD_PENDING: frozenset({S.LOADING}),
    S.LOADING: frozenset({S.QUEUED, S.FAILED, S.ABORTING, S.STOPPED}),
    S.QUEUED: frozenset({S.PULLED, S.FAILED, S.ABORTING}),
    S.PULLED: frozenset({S.RECEIVING, S.LANDED, S.FAILED, S.ABORTING}),
    S.RECEIVING: frozenset({S.RECEIVING, S.LANDED, S.FAILED, S.ABORTING}),
    S.LANDED: frozenset({S.REPORTED, S.STOPPED}),
    S.REPORTED: frozenset({S.STOPPED}),
    S.FAILED: frozenset({S.STOPPED}),
    S.ABORTING: frozenset({S.ABORTING, S.STOPPED}),
    S.STOPPED: frozenset({S.STOPPED}),
}


@dataclass
class Transfer:
    request_id: str
    block_ids: list[int] = field(default_factory=list)  # where blocks first_block.. of the prompt land
    num_tokens: int = 0
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    first_block: int = 0
    state: ConsumerState | None = None  # moved by ConsumerTable only
    link: PairReceiver | None = None  # the thread that receives it
    started: float = field(default_factory=time.monotonic)
    first_byte: float | None = None  # its first layer arrived: the transfer rate runs from here to DONE
    last_landed: float | None = None  # its latest layer landed: the link's deadline runs from here
    layers: set[int] = field(default_factory=set)
    nbytes: int = 0
    retried: bool = False  # asked again on a new pair after the producer forgot the old one
    nonce: int = field(default_factory=new_nonce)  # in PULL; DONE must echo it (verify.py)
    checksums: dict[int, int] = field(default_factory=dict)  # layer -> CRC-32 of what landed (checksummed pairs)
    # what DONE brought (LANDED), or why it failed (FAILED)
    first_token: int = 0
    first_logprobs: dict[int, float] | None = None
    choices: list[tuple[int, dict[int, float] | None]] = field(default_factory=list)  # n > 1: choices 1..
    cached_tokens: int = 0  # prompt tokens the producer served from its prefix cache
    error: str = ""

    @property
    def live(self) -> bool:
        """The I/O thread works on it (or is about to): KV may still land in its blocks."""
        return self.state in (S.QUEUED, S.PULLED, S.RECEIVING)


class ConsumerTable:
    """The decode node's records, by request id; every field of a record is written here."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._records: dict[str, Transfer] = {}

    def __len__(self) -> int:
        return len(self._records)

    def state(self, request_id: str) -> ConsumerState | None:
        with self.lock:
            t = self._records.get(request_id)
            return t.state if t is not None else None

    @staticmethod
    def _move(t: Transfer, to: ConsumerState) -> None:
        """The one place a state changes (lock held)."""
        if to not in MOVES[t.state]:
            raise IllegalMove(f"transfer {t.request_id}: {t.state and t.state.name} -> {to.name}")
        t.state = to

    def _new(self, request_id: str, to: ConsumerState) -> Transfer:
        t = self._records[request_id] = Transfer(request_id)
        self._move(t, to)
        return t

    # ---- scheduler side (engine thread) -------------------------------------------------
    def load_pending(self, request_id: str) -> None:
        with self.lock:
            self._new(request_id, S.LOAD_PENDING)

    def cancel_pending(self, request_id: str) -> bool:
        """Forget a load not yet issued; False if it was issued already."""
        with self.lock:
            t = self._records.get(request_id)
            if t is None or t.state is not S.LOAD_PENDING:
                return False
            del self._records[request_id]
            return True

    def issue(self, request_id: str) -> None:
        with self.lock:
            t = self._records.get(request_id)
            if t is not None and t.state is S.LOAD_PENDING:
                self._move(t, S.LOADING)

    def abort(self, request_id: str) -> bool:
        """The request ended: True (ABORTING, blocks held) when KV may still land in its blocks;
        else its record goes (nothing writes there)."""
        with self.lock:
            t = self._records.get(request_id)
            if t is not None and t.state.receiving:
                self._move(t, S.ABORTING)
                return True
            return False

    def forget(self, ended, stopped) -> None:
        """The scheduler applied these reports (``ended``: landed or failed; ``stopped``: aborts
        that stopped): their records go, if still there (the worker's polls take them first)."""
        with self.lock:
            for rid in ended:
                if (t := self._records.get(rid)) is not None and t.state.receiving:
                    del self._records[rid]
            for rid in stopped:
                if (t := self._records.get(rid)) is not None and t.state in (S.ABORTING, S.STOPPED):
                    del self._records[rid]

    # ---- KV endpoint (engine thread: worker side) ------------------------------------
    def start(self, request_id: str, block_ids: list[int], num_tokens: int, kv_caches: list[torch.Tensor],
              first_block: int, link: PairReceiver | None, error: str = "") -> Transfer | None:
        """The load goes out: its planned record (or a new one) is filled in and QUEUED on
        ``link``, or FAILED with ``error``. None when the request was aborted meanwhile (nothing
        is queued). A record left over from an earlier load of the same id (ended, not yet
        polled) is replaced: its link may still hold it."""
        with self.lock:
            t = self._records.get(request_id)
            if t is not None and t.state is S.ABORTING:
                return None
            if t is None or t.state not in (S.LOAD_PENDING, S.LOADING):
                t = self._records[request_id] = Transfer(request_id)
            elif t.state is S.LOAD_PENDING:
                self._move(t, S.LOADING)  # issued by the KV endpoint's own caller (no scheduler)
            t.block_ids, t.num_tokens, t.kv_caches, t.first_block = list(block_ids), num_tokens, kv_caches, first_block
            t.link, t.error, t.started = link, error, time.monotonic()
            self._move(t, S.FAILED if error else S.QUEUED)
            return t

    def stop(self, request_id: str) -> PairReceiver | None:
        """Abort issued: the link that may still receive into the blocks (ABORTING until it says
        it stopped), or None and the record is STOPPED now."""
        with self.lock:
            t = self._records.get(request_id)
            if t is not None and t.link is not None and t.state in (S.ABORTING, S.QUEUED, S.PULLED, S.RECEIVING):
                self._move(t, S.ABORTING)
                return t.link
            if t is None or t.state is S.LOAD_PENDING:  # a pending load never issued: nothing can land
                self._new(request_id, S.STOPPED)
            else:
                self._move(t, S.STOPPED)
            return None

    # ---- the I/O thread: what the links report---------------------------------------------------
    def pull_sent(self, t: Transfer) -> None:
        """The PULL is out (PULLED); ignored once the transfer left the link."""
        with self.lock:
            if t.state is S.QUEUED:
                self._move(t, S.PULLED)

    def retry(self, t: Transfer) -> bool:
        """The producer forgot the pair: asked again once on a new one (False: asked again already)."""
        with self.lock:
            retried, t.retried = t.retried, True
            return not retried

    def first_byte(self, t: Transfer) -> None:
        """Bytes of ``t`` started arriving: its transfer rate runs from now."""
        with self.lock:
            if t.first_byte is None:
                t.first_byte = time.monotonic()

    def layers_landed(self, t: Transfer, layers, nbytes: int, checksums: dict[int, int]) -> None:
        """``layers`` (``nbytes``, their CRC-32s on a checksummed pair) are in the blocks (RECEIVING);
        ignored once the transfer left the link."""
        with self.lock:
            t.checksums.update(checksums)
            t.layers.update(layers)
            t.nbytes += nbytes
            t.last_landed = time.monotonic()
            if t.live:
                self._move(t, S.RECEIVING)

    def finish(self, t: Transfer, state: ConsumerState, **result) -> bool:
        """LANDED or FAILED with what came (``first_token``…, or ``error``); False if it was
        aborted or replaced meanwhile."""
        with self.lock:
            if not t.live or self._records.get(t.request_id) is not t:
                return False
            self._move(t, state)
            for name, value in result.items():
                setattr(t, name, value)
            return True

    def abort_stopped(self, request_id: str) -> None:
        with self.lock:
            t = self._records.get(request_id)
            if t is None:
                self._new(request_id, S.STOPPED)
            elif t.state is S.ABORTING:
                self._move(t, S.STOPPED)

    # ---- polls (engine thread: worker side) ------------------------------------------------
    def poll_finished(self) -> tuple[dict[str, int], dict[str, str]]:
        with self.lock:
            done, failed = {}, {}
            for rid, t in list(self._records.items()):
                if t.state is S.REPORTED:
                    del self._records[rid]  # nobody took its extras
                elif t.state is S.LANDED:
                    self._move(t, S.REPORTED)
                    done[rid] = t.first_token
                elif t.state is S.FAILED:
                    del self._records[rid]
                    failed[rid] = t.error
        return done, failed

    def take_landed(self, request_ids) -> dict[str, Transfer]:
        with self.lock:
            out = {rid: t for rid in request_ids if (t := self._records.get(rid)) is not None
                   and t.state is S.REPORTED}
            for rid in out:
                del self._records[rid]
        return out

    def poll_aborted(self) -> set[str]:
        with self.lock:
            out = {rid for rid, t in self._records.items() if t.state is S.STOPPED}
            for rid in out:
                del self._records[rid]
        return out

    def value(self, request_id: str) -> str:
        """The state's value; "unknown" when there is no record or it was polled."""
        with self.lock:
            t = self._records.get(request_id)
            return t.state.value if t is not None and t.state is not S.REPORTED else "unknown"
