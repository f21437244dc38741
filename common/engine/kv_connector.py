"""How a KV transfer plugs into the engine: vLLM v1's connector split, our way.

A connector is two halves (:class:`KVConnector`) that share nothing but one metadata
object per step:

Scheduler side (:class:`KVConnectorScheduler`), inside the ``Scheduler``; pure bookkeeping,
no KV endpoint, no network. It decides, from the ``Sequence`` objects it sees:
  * which requests load which blocks from which peer (``num_external_tokens`` > 0: the
    scheduler allocates blocks for the whole prompt and calls ``on_blocks_allocated``; with
    prefix caching only the blocks after ``first_block`` are asked for);
  * which requests save KV in this step (their row in the batch, the peer, the blocks):
    only the pass that completes the prompt saves, earlier chunks go out from the blocks;
  * which finished requests are handed over (first token, its logprobs, blocks) or
    discarded, which loads are aborted, and which requests tagged for a load compute their
    few uncached tokens here instead (``prefill_here``; the peer is told to drop the KV), and
    which parked requests whose peer gave no pair are computed here after all (``fall_back``);
  * whether the scheduler holds a finished request's blocks (``request_finished``), read
    from the side's one table of transfers (request id -> record with one state: the
    transfer layer's ``ProducerState`` or ``ConsumerState``), which the KV endpoint
    updates too (shared at ``bind``).
Everything decided since the last metadata goes into the next :class:`KVConnectorMetadata`
(``build_meta``): frozen dataclasses of ids, ints and strings, no ``Sequence``. The engine
gives the workers the one built at schedule time before the forward, and what the step's
postprocess decided (a first token to hand over) at the end of that same step, so a
hand-over never waits for the next step or the async loop's poll interval.

Worker side (:class:`KVConnectorWorker`), next to the model; the only half that touches
the KV endpoint. Per step: ``issue(meta)`` with the metadata built at schedule time,
before the forward (loads, discards, aborts), and again at the end of the step with what
its postprocess decided (hand-overs), ``save_kv_layer(layer_idx, kv_layer, meta)`` after each
attention layer when ``meta.saves`` is not empty, ``get_finished()`` polled at the start of
every step. It keeps no table of live transfers: the side's one table, which the scheduler
side reads, is the KV endpoint's.

Tensor parallelism (``tp_ranks``): every rank's worker side gets the same metadata (block ids
are the same on every rank; each rank moves its own heads at its own endpoint) and the
scheduler side needs no change but one hook (``still_landing``); ``get_finished`` is
combined over the ranks (a request is done when every rank says so, as vLLM's
``KVOutputAggregator``).

Role ``both`` uses :func:`no_connector` (no transfer).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from common.engine.sequence import Sequence


@dataclass(frozen=True)
class LoadSpec:
    """Consumer: land blocks ``first_block``.. of the peer's prompt KV in ``block_ids``."""

    request_id: str
    prefill_addr: str
    block_ids: tuple[int, ...]
    first_block: int  # the blocks before it are cached here already
    num_prompt_tokens: int
    src_tp: int = 0  # the prefill node's tensor-parallel size (0: unknown, taken as this node's)


@dataclass(frozen=True)
class SaveSpec:
    """Producer: this step's pass completes the prompt of the request at ``row`` of the batch."""

    request_id: str
    row: int
    decode_addr: str
    block_ids: tuple[int, ...]  # the request's whole block table
    num_prompt_tokens: int


@dataclass(frozen=True)
class HandoverSpec:
    """Producer: the prompt is done; the peer gets the rest of the KV and the first token."""

    request_id: str
    decode_addr: str
    first_token: int
    first_logprobs: tuple[tuple[int, float], ...] | None
    block_ids: tuple[int, ...]
    num_prompt_tokens: int
    # n > 1: choices 1..'s first tokens, each with its logprobs ([[token_id, logprob], ...] or [])
    choices: tuple[tuple[int, tuple[tuple[int, float], ...]], ...] = ()
    num_cached_tokens: int = 0  # of the prompt, found in this node's prefix cache (usage's cached_tokens)


@dataclass(frozen=True)
class DiscardSpec:
    """Producer: the request ended before its first token; tell a waiting peer why."""

    request_id: str
    why: str


@dataclass(frozen=True)
class KVConnectorMetadata:
    """One step's decisions, from the scheduler side to every worker."""

    loads: tuple[LoadSpec, ...] = ()
    saves: tuple[SaveSpec, ...] = ()
    handovers: tuple[HandoverSpec, ...] = ()
    discards: tuple[DiscardSpec, ...] = ()
    aborts: tuple[str, ...] = ()  # consumer: request ids whose load stops
    releases: tuple[tuple[str, str], ...] = ()  # consumer: (request id, peer) never loaded: the peer drops it

    def __bool__(self) -> bool:
        return bool(self.loads or self.saves or self.handovers or self.discards or self.aborts or self.releases)


EMPTY_METADATA = KVConnectorMetadata()


@dataclass
class FinishedTransfers:
    """What the worker side reports each step (the scheduler applies it to the sequences it still
    parks or holds; a report for any other request is ignored)."""

    # producer: requests whose KV the peer acknowledged (or that were aborted, failed or whose
    # lease expired): their blocks may be freed now
    freeable: set[str] = field(default_factory=set)
    # consumer: aborted requests whose receive has stopped: nothing writes into their blocks any more
    stopped: set[str] = field(default_factory=set)
    # consumer: requests whose whole prompt KV landed: request_id -> first token id from the producer
    done_recving: dict[str, int] = field(default_factory=dict)
    # consumer: the first token's logprobs from the producer, for landed requests that asked
    first_logprobs: dict[str, dict[int, float]] = field(default_factory=dict)
    # consumer, n > 1: the first tokens (and logprobs) of choices 1.. that came with choice 0's
    choice_firsts: dict[str, list[tuple[int, dict[int, float] | None]]] = field(default_factory=dict)
    # consumer: prompt tokens the producer served from its prefix cache, for landed requests
    cached_tokens: dict[str, int] = field(default_factory=dict)
    # consumer: requests whose transfer failed: request_id -> error message (request fails, blocks freed)
    failed_recving: dict[str, str] = field(default_factory=dict)
    # consumer: requests whose pair could not be had (nothing asked for, nothing landed): request_id ->
    # reason; their prompts are computed here instead (``KVConnectorScheduler.fall_back``)
    prefill_here: dict[str, str] = field(default_factory=dict)


class KVConnectorScheduler:
    """Scheduler side with no transfer (role ``both``); the roles override the decisions.

    Holds no KV endpoint: decisions land in the pending lists that ``build_meta`` drains;
    a role's states live in its one table of transfers (``state`` reads it)."""

    def __init__(self) -> None:
        self._loads: list[LoadSpec] = []
        self._handovers: list[HandoverSpec] = []
        self._discards: list[DiscardSpec] = []
        self._aborts: list[str] = []
        self._releases: list[tuple[str, str]] = []

    def state(self, request_id: str) -> enum.Enum | None:
        """The request's transfer state, the role's own enum (None: no transfer)."""
        return None

    # ---- decisions (called by the Scheduler) ---------------------------------------------
    def num_external_tokens(self, seq: Sequence) -> int:
        """Prompt tokens whose KV arrives from a peer (0: compute them here)."""
        return 0

    def on_blocks_allocated(self, seq: Sequence, first_block: int) -> None:
        """``seq`` holds blocks for its whole prompt; the first ``first_block`` are cached here."""

    def prefill_here(self, seq: Sequence, num_uncached: int, max_tokens: int) -> bool:
        """A request tagged for remote KV whose prompt lacks only ``num_uncached`` tokens here:
        True to compute them here instead (``max_tokens``: what one stall-bounded step holds)."""
        return False

    def fall_back(self, seq: Sequence, reason: str) -> None:
        """``seq``'s KV cannot come from its peer (``FinishedTransfers.prefill_here``): the
        scheduler computes its prompt here, as a local prefill."""

    def saves(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[SaveSpec]:
        """Rows of the scheduled batch whose KV the workers save during the forward."""
        return []

    def request_finished(self, seq: Sequence) -> bool:
        """``seq`` finished or was aborted; True: the scheduler holds its blocks until
        ``freeable`` (producer) or ``stopped`` (consumer) names it."""
        return False

    def update_finished(self, finished: FinishedTransfers) -> FinishedTransfers:
        """The workers' report, kept only where the table expects it; the table follows."""
        return FinishedTransfers()

    # ---- the metadata ---------------------------------------------------------------------
    def has_pending(self) -> bool:
        return bool(self._loads or self._handovers or self._discards or self._aborts or self._releases)

    def build_meta(self, seqs: list[Sequence] | None = None,
                   num_new_tokens: list[int] | None = None) -> KVConnectorMetadata:
        """Everything decided since the last call, plus the saves of the batch ``seqs`` (if any)."""
        saves = self.saves(seqs, num_new_tokens or []) if seqs else []
        if not (saves or self.has_pending()):
            return EMPTY_METADATA
        meta = KVConnectorMetadata(tuple(self._loads), tuple(saves), tuple(self._handovers),
                                   tuple(self._discards), tuple(self._aborts), tuple(self._releases))
        self._loads, self._handovers, self._discards, self._aborts, self._releases = [], [], [], [], []
        return meta


class KVConnectorWorker:
    """Worker side with no transfer: nothing to move, nothing finishes."""

    def issue(self, meta: KVConnectorMetadata) -> None:
        """Carry out ``meta``'s loads, hand-overs, discards, aborts and releases (the engine calls
        it before the forward with the schedule's metadata, and at the end of the step with what
        the postprocess decided)."""

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, meta: KVConnectorMetadata) -> None:
        """After attention layer ``layer_idx`` wrote its KV, for ``meta.saves``."""

    def get_finished(self) -> FinishedTransfers:
        return FinishedTransfers()


class TransferWorker(KVConnectorWorker):
    """A worker side that moves bytes with the daemon's KV endpoint (``bind``, once both
    the engine's KV cache and the KV endpoint exist; until then it does nothing). The
    KV endpoint's type is the KV transfer layer's, above this one: the engine only holds it
    for the worker sides that use it (``common/kv_transfer/workers.py``)."""

    def __init__(self) -> None:
        self.transfer: Any = None  # the daemon's KVEndpoint, once bound
        self.kv_caches: list[torch.Tensor] = []

    def bind(self, transfer: Any, kv_caches: list[torch.Tensor]) -> None:
        self.transfer, self.kv_caches = transfer, kv_caches


@dataclass
class KVConnector:
    """The engine's connector: a scheduler side and a worker side."""

    scheduler: KVConnectorScheduler
    worker: KVConnectorWorker

    def bind(self, transfer: Any, kv_caches: list[torch.Tensor]) -> None:
        """The daemon's hook: hand the worker side its KV endpoint and the KV cache."""
        assert isinstance(self.worker, TransferWorker), "this connector moves no KV"
        self.worker.bind(transfer, kv_caches)


def no_connector() -> KVConnector:
    return KVConnector(KVConnectorScheduler(), KVConnectorWorker())
