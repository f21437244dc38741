"""N parts of one transfer, one outcome (in the spirit of vLLM's ``KVOutputAggregator``).

A request's KV moves in parts: one per tensor-parallel rank (``tp_ranks``: rank 0 combines its
workers' reports), one per route (``tp_routes``: a decode rank's loads from a larger prefill
node), one per KV rank (``tp_slices``: a prefill rank's head slices). :class:`RankOutcomes`
expects a count of parts per request and gives the scheduler one outcome:

* a load landed when every part landed (the first token is part 0's); the first part that
  fails makes it fail once, with that part's reason, and the others are told to stop; the
  failure is reported only when no part can write into the blocks any more, so the scheduler
  frees them once for all parts;
* a hand-over's blocks are freeable when every part released them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.engine.kv_connector import FinishedTransfers
from common.kv_transfer.consumer_table import ConsumerState

STOPPED = ConsumerState.STOPPED  # a rank's part ended by an abort (its table's own state)


@dataclass
class _Load:
    ranks: frozenset[int]  # the ranks whose part this load waits for
    ended: dict[int, str | ConsumerState | None] = field(default_factory=dict)  # rank -> None (landed), its error, or STOPPED
    aborted: bool = False  # by the scheduler: the outcome is "stopped"
    aborting: bool = False  # a rank failed: the others were told to stop
    error: str = ""  # the first rank's failure
    landed: FinishedTransfers | None = None  # rank 0's report of its landing (first token, extras)

    @property
    def complete(self) -> bool:
        return self.ranks <= self.ended.keys()


class RankOutcomes:
    """Rank 0's view of every multi-rank transfer still in progress (decode: loads; prefill:
    blocks held for a hand-over), and the one outcome each gets."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.loads: dict[str, _Load] = {}
        self.held: dict[str, set[int]] = {}  # prefill: request id -> ranks that released it

    def expect_load(self, request_id: str, ranks: frozenset[int] | None = None) -> None:
        self.loads[request_id] = _Load(ranks if ranks is not None else frozenset(range(self.size)))

    def expect_release(self, request_id: str) -> None:
        self.held[request_id] = set()

    def aborted(self, request_id: str) -> None:
        """The scheduler aborted the load: once no rank writes into its blocks, it is "stopped"."""
        if (load := self.loads.get(request_id)) is not None:
            load.aborted = True

    @property
    def pending(self) -> bool:
        """Does any part's report still count (a load or a hand-over not yet settled)?"""
        return bool(self.loads or self.held)

    def landing(self, request_id: str) -> bool:
        """May a rank still write into this request's blocks?"""
        return request_id in self.loads

    def combine(self, reports: list[FinishedTransfers]) -> tuple[FinishedTransfers, list[str]]:
        """Every rank's report (rank 0's first) -> the one report the scheduler applies, and the
        loads whose other ranks must now be told to stop (a rank failed)."""
        out = FinishedTransfers()
        touched: list[str] = []
        for rank, rep in enumerate(reports):
            for rid in rep.freeable:
                if (released := self.held.get(rid)) is None:
                    if rank == 0:
                        out.freeable.add(rid)  # not a held hand-over: the scheduler knows what it holds
                    continue
                released.add(rank)
                if len(released) == self.size:
                    del self.held[rid]
                    out.freeable.add(rid)
            ends = [(rid, None) for rid in rep.done_recving] + list(rep.failed_recving.items()) + \
                   [(rid, STOPPED) for rid in rep.stopped]
            for rid, end in ends:
                load = self.loads.get(rid)
                if load is None or rank not in load.ranks:
                    if rank == 0:
                        _pass_on(out, rep, rid, end)  # not a load of ours (never issued to the workers)
                    continue
                load.ended[rank] = end
                if rank == 0 and end is None:
                    load.landed = rep
                if isinstance(end, str) and not load.error:
                    load.error = f"tensor-parallel rank {rank}: {end}" if self.size > 1 else end
                touched.append(rid)
        to_stop = []
        for rid in dict.fromkeys(touched):
            load = self.loads[rid]
            if load.complete:
                del self.loads[rid]
                if load.aborted:
                    out.stopped.add(rid)
                elif load.error or load.landed is None or STOPPED in load.ended.values():
                    out.failed_recving[rid] = load.error or "a tensor-parallel rank's part stopped unasked"
                else:
                    _pass_on(out, load.landed, rid, None)
            elif load.error and not (load.aborting or load.aborted):
                load.aborting = True
                to_stop.append(rid)
        return out, to_stop


def _pass_on(out: FinishedTransfers, rep: FinishedTransfers, rid: str, end: object) -> None:
    """Copy ``rid``'s ending from rank 0's report ``rep`` into ``out``."""
    if end is STOPPED:
        out.stopped.add(rid)
    elif isinstance(end, str):
        out.failed_recving[rid] = end
    else:
        out.done_recving[rid] = rep.done_recving[rid]
        for name in ("first_logprobs", "choice_firsts", "cached_tokens"):
            if rid in (extras := getattr(rep, name)):
                getattr(out, name)[rid] = extras[rid]
