"""The decode node's one table of transfers: one record per request, one state, its moves.

The scheduler side of the consumer connector (engine thread) and :class:`KVConsumer` with
its link threads share this table (the connector takes the transfer engine's at ``bind``);
every state change is one of the methods below, under the table's lock. A link thread keeps
references to the records it works on, never copies of their state.

| state        | entered by (thread)                                  | next                            |
|--------------|------------------------------------------------------|---------------------------------|
| LOAD_PENDING | ``plan``: blocks allocated (engine, scheduler)       | LOADING; gone (``unplan``)      |
| LOADING      | ``issue``: the load is in the metadata (engine)      | QUEUED, FAILED; ABORTING        |
| QUEUED       | ``start``: ``KVConsumer.request`` (engine, worker)   | PULLED, FAILED; ABORTING        |
| PULLED       | ``advance``: PULL sent (link)                        | RECEIVING, LANDED, FAILED; ABORTING |
| RECEIVING    | ``advance``: a layer landed (link)                   | LANDED, FAILED; ABORTING        |
| LANDED       | ``finish``: DONE checked (link)                      | REPORTED (``poll_finished``); STOPPED (``stop``) |
| REPORTED     | ``poll_finished`` (engine)                           | gone (``take_landed``, next poll) |
| FAILED       | ``finish`` (link), or ``start`` of a refused request | gone (``poll_finished``); STOPPED (``stop``) |
| ABORTING     | ``abort`` (scheduler) or ``stop`` (worker) of a load that may still land (engine) | STOPPED (``abort_stopped``, link) |
| STOPPED      | ``abort_stopped`` (link); ``stop`` of one nothing writes into | gone (``poll_aborted``)  |

ABORTING wins every race: a landing or a failure after it is ignored, and the blocks stay
held until the link says it stopped.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.engine.kv_connector import ConnectorState
from common.kv_transfer.verify import new_nonce

if TYPE_CHECKING:
    from common.kv_transfer.receiver import PairReceiver

S = ConnectorState


@dataclass
class Transfer:
    request_id: str
    block_ids: list[int] = field(default_factory=list)  # where blocks first_block.. of the prompt land
    num_tokens: int = 0
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    first_block: int = 0
    state: ConnectorState = S.QUEUED  # changed by ConsumerTable only
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
        """A link thread works on it (or is about to): KV may still land in its blocks."""
        return self.state in (S.QUEUED, S.PULLED, S.RECEIVING)


class ConsumerTable:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._records: dict[str, Transfer] = {}

    def __len__(self) -> int:
        return len(self._records)

    def state(self, request_id: str) -> ConnectorState | None:
        with self.lock:
            t = self._records.get(request_id)
            return t.state if t is not None else None

    # ---- scheduler side (engine thread) -------------------------------------------------
    def plan(self, request_id: str) -> None:
        with self.lock:
            self._records[request_id] = Transfer(request_id, state=S.LOAD_PENDING)

    def unplan(self, request_id: str) -> bool:
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
                t.state = S.LOADING

    def abort(self, request_id: str) -> bool:
        """The request ended: True (ABORTING, blocks held) when KV may still land in its blocks;
        else its record goes (nothing writes there)."""
        with self.lock:
            t = self._records.get(request_id)
            if t is not None and t.state.receiving:
                t.state = S.ABORTING
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

    # ---- transfer engine (engine thread: worker side) ------------------------------------
    def start(self, t: Transfer, link: PairReceiver | None, error: str = "") -> bool:
        """``t`` replaces the request's record: QUEUED on ``link``, or FAILED with ``error``.
        False when the request was aborted meanwhile (nothing is queued)."""
        with self.lock:
            old = self._records.get(t.request_id)
            if old is not None and old.state is S.ABORTING:
                return False
            t.link, t.state, t.error = link, (S.FAILED if error else S.QUEUED), error
            self._records[t.request_id] = t
            return True

    def stop(self, request_id: str) -> PairReceiver | None:
        """Abort issued: the link that may still receive into the blocks (ABORTING until it says
        it stopped), or None and the record is STOPPED now."""
        with self.lock:
            t = self._records.get(request_id)
            if t is not None and t.link is not None and t.state in (S.ABORTING, S.QUEUED, S.PULLED, S.RECEIVING):
                t.state = S.ABORTING
                return t.link
            self._records[request_id] = Transfer(request_id, state=S.STOPPED)
            return None

    # ---- link threads ---------------------------------------------------------------------
    def advance(self, t: Transfer, state: ConnectorState) -> None:
        """PULL sent (PULLED) or a layer landed (RECEIVING); ignored once it left the link."""
        with self.lock:
            if t.live:
                t.state = state

    def finish(self, t: Transfer, state: ConnectorState, **result) -> bool:
        """LANDED or FAILED with what came (``first_token``…, or ``error``); False if it was
        aborted or replaced meanwhile."""
        with self.lock:
            if not t.live or self._records.get(t.request_id) is not t:
                return False
            t.state = state
            for name, value in result.items():
                setattr(t, name, value)
            return True

    def abort_stopped(self, request_id: str) -> None:
        with self.lock:
            t = self._records.get(request_id)
            if t is None:
                self._records[request_id] = Transfer(request_id, state=S.STOPPED)
            elif t.state is S.ABORTING:
                t.state = S.STOPPED

    # ---- polls (engine thread: worker side) ------------------------------------------------
    def poll_finished(self) -> tuple[dict[str, int], dict[str, str]]:
        with self.lock:
            done, failed = {}, {}
            for rid, t in list(self._records.items()):
                if t.state is S.REPORTED:
                    del self._records[rid]  # nobody took its extras
                elif t.state is S.LANDED:
                    t.state, done[rid] = S.REPORTED, t.first_token
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
