"""Fair share between clients: a Virtual Token Counter (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024) deciding which waiting sequence the scheduler admits next.

Each client (``SamplingParams.client``: an API key's hash, a tenant's cache salt, the OpenAI
``user`` field, or "" for everyone else) has a counter of the tokens it was served: prompt tokens
weighted by ``PROMPT_WEIGHT`` when a sequence is first admitted, output tokens as they are
sampled. Admission takes the waiting client with the smallest counter first, FIFO within a client.
A client that becomes active again (nothing waiting or running before) is lifted to the smallest
counter of the active clients, so an idle client banks no credit (VTC's rule).

What a client holds is the sum of ``max_tokens`` over its running sequences (a request whose
``n`` choices all run holds ``n × max_tokens``; a prompt not yet forked counts for its ``n``).
A client whose next sequence would take it past ``max_tokens_in_flight`` is admitted only when
no client under its cap waits; a client already past it has its newest running sequences (the
newest of those preempted least, so no one sequence takes every delay) preempted to make room (a slot, the blocks of a prompt's next chunk) for a client under its cap
(a preempted sequence would take its client past the cap again, so it does not come straight
back). A client holding nothing is never over its cap, so one request larger than the cap runs.

A step full of one client's decodes or prompts is many times an idle step on a CPU: while one
client holds at least half the running slots, or has prompt tokens left for at least half the
step's token budget (a burst of requests just in), the first request of each client that runs
nothing gets its prompt (or its first chunk, within the stall bound) computed in a step of its own
before the others' next step (:meth:`newcomers`; never two such steps in a row, so the others miss
at most every other step).

With one client, or off (``enabled=False``: the counters still run), nothing is reordered and
nothing is preempted: admission is the plain FIFO.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from common.engine.sequence import Sequence

PROMPT_WEIGHT = 0.5  # a prompt token costs half an output token (VTC's w_p : w_q = 1 : 2)
DEFAULT_MAX_TOKENS_IN_FLIGHT_PER_CLIENT = 4096
_MAX_IDLE_CLIENTS = 4096  # counters of inactive clients kept; past it they are dropped (lifted anyway)


def client_of(seq: Sequence) -> str:
    return seq.params.client


def held_cost(seq: Sequence) -> int:
    """What a running ``seq`` holds of its client's cap: its ``max_tokens``, times ``n`` until forked."""
    unforked = seq.params.n > 1 and not seq.choice_firsts  # fork() sets it on the parent
    return seq.params.max_tokens * (seq.params.n if unforked else 1)


@dataclass
class FairShare:
    """The counters and the admission order; the scheduler reports arrivals, service and departures."""

    max_tokens_in_flight: int = DEFAULT_MAX_TOKENS_IN_FLIGHT_PER_CLIENT
    enabled: bool = True
    counters: dict[str, float] = field(default_factory=dict)
    live: dict[str, int] = field(default_factory=dict)  # client -> sequences waiting, parked or running
    charged: set[str] = field(default_factory=set)  # request ids whose prompt is counted (until they leave)

    # ---- events -------------------------------------------------------------------------
    def arrived(self, seq: Sequence) -> None:
        """A new sequence (a request or a forked choice) is queued."""
        client = client_of(seq)
        if seq.group_id:  # a choice: its prompt was its parent's
            self.charged.add(seq.request_id)
        if not self.live.get(client):
            active = [self.counters.get(c, 0.0) for c, n in self.live.items() if n]
            floor = min(active) if active else 0.0
            self.counters[client] = max(self.counters.get(client, 0.0), floor)
        self.live[client] = self.live.get(client, 0) + 1

    def admitted(self, seq: Sequence) -> None:
        """``seq`` leaves the waiting queue (to run, or parked for remote KV): its prompt is
        counted once, whatever preemptions or fallbacks bring it back."""
        if seq.request_id not in self.charged:
            self.charged.add(seq.request_id)
            self.served(client_of(seq), prompt_tokens=seq.num_prompt_tokens)

    def left(self, seq: Sequence) -> None:
        """A sequence finished (any reason)."""
        client = client_of(seq)
        self.charged.discard(seq.request_id)
        n = self.live.get(client, 0) - 1
        if n > 0:
            self.live[client] = n
            return
        self.live.pop(client, None)
        if len(self.counters) > _MAX_IDLE_CLIENTS:
            self.counters = {c: v for c, v in self.counters.items() if c in self.live}

    def served(self, client: str, prompt_tokens: int = 0, output_tokens: int = 0) -> None:
        self.counters[client] = self.counters.get(client, 0.0) + PROMPT_WEIGHT * prompt_tokens + output_tokens

    # ---- decisions ----------------------------------------------------------------------
    def held(self, running: Iterable[Sequence]) -> dict[str, int]:
        held: dict[str, int] = {}
        for seq in running:
            held[client_of(seq)] = held.get(client_of(seq), 0) + held_cost(seq)
        return held

    def over_cap(self, client: str, held: dict[str, int], adding: int = 0) -> bool:
        """``client`` holds something and would hold more than its cap with ``adding`` more."""
        holds = held.get(client, 0)
        return holds > 0 and holds + adding > self.max_tokens_in_flight

    def pick(self, waiting: deque[Sequence], running: list[Sequence]) -> Sequence:
        """The next sequence to admit (``waiting`` is not empty): each client's first waiting
        sequence, the client under its cap with the smallest counter first (ties: the earlier)."""
        if not self.enabled or len(self.live) <= 1:  # one client: FIFO, as without fair share
            return waiting[0]
        return self._pick(waiting, self.held(running))

    def needs_room(self, waiting: deque[Sequence], running: list[Sequence]) -> Sequence | None:
        """The next admission when it is a client's under its cap beside another client (it may
        take room from a client over its cap), else None."""
        if not self.enabled or not waiting or len(self.live) <= 1:
            return None
        held = self.held(running)
        seq = self._pick(waiting, held)
        return None if self.over_cap(client_of(seq), held, held_cost(seq)) else seq

    def newcomers(self, waiting: Iterable[Sequence], running: list[Sequence], max_num_seqs: int,
                  max_num_batched_tokens: int) -> list[Sequence]:
        """While one client holds at least half the running slots, or has prompt tokens left for at
        least half the step's token budget (waiting or running, besides what this step would take
        as its newcomer): the first waiting sequence of each client that runs nothing, in queue
        order (the scheduler gives their prompts a step of their own, so a small request's first
        token does not wait for a step full of another client's decodes or prompts). Empty with one
        client, off, or when no client holds that much."""
        if not self.enabled or len(self.live) <= 1:
            return []
        slots: dict[str, int] = {}
        for seq in running:
            slots[client_of(seq)] = slots.get(client_of(seq), 0) + 1
        out: list[Sequence] = []
        seen = set(slots)
        for seq in waiting:
            if client_of(seq) not in seen:
                seen.add(client_of(seq))  # its first sequence only
                out.append(seq)
        if max(slots.values(), default=0) < max(2, max_num_seqs // 2) and not self._prompts_fill(
                waiting, running, out, max_num_batched_tokens // 2):
            return []
        return out

    @staticmethod
    def _prompts_fill(waiting: Iterable[Sequence], running: list[Sequence], newcomers: list[Sequence],
                      tokens: int) -> bool:
        """One client has at least ``tokens`` prompt tokens left, waiting or running, besides
        ``newcomers``: the prompts a mixed step would carry beside theirs."""
        left: dict[str, int] = {}
        skip = {id(seq) for seq in newcomers}
        for seq in (*running, *waiting):
            if seq.is_prefill and id(seq) not in skip:
                left[client_of(seq)] = left.get(client_of(seq), 0) + seq.num_uncomputed_tokens
                if left[client_of(seq)] >= tokens:
                    return True
        return False

    def victim(self, running: list[Sequence], for_seq: Sequence) -> Sequence | None:
        """The running sequence of another client over its cap to preempt for ``for_seq``: the newest
        of those preempted least so far. Always the newest, one sequence took every preemption and
        finished last by all their delays together: in bench/fairness.py's flood, 9.5 % more steps
        for the same tokens than without fair share."""
        held = self.held(running)
        over = [s for s in running if client_of(s) != client_of(for_seq) and self.over_cap(client_of(s), held)]
        if not over:
            return None
        fewest = min(s.num_preemptions for s in over)
        return next(s for s in reversed(over) if s.num_preemptions == fewest)

    def _pick(self, waiting: Iterable[Sequence], held: dict[str, int]) -> Sequence:
        best, best_key = None, None
        seen: set[str] = set()
        for position, seq in enumerate(waiting):
            client = client_of(seq)
            if client in seen:
                continue
            seen.add(client)
            key = (self.over_cap(client, held, held_cost(seq)), self.counters.get(client, 0.0), position)
            if best_key is None or key < best_key:
                best, best_key = seq, key
        assert best is not None
        return best
