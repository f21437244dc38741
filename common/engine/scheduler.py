"""Continuous batching: which sequences run this step and how many tokens each computes.

Queues: ``waiting`` (FIFO, new and preempted) -> ``running`` (at most ``max_num_seqs``)
-> finished. With a consumer connector a new sequence whose prompt KV comes from a peer
goes ``waiting`` -> ``parked`` (blocks for the whole prompt held, no running slot) and,
once ``get_finished`` reports the KV landed with the first token, back to the front of
``waiting`` with its prompt marked computed. With a producer connector a finished
sequence may sit in ``held`` (blocks kept) until the peer has read its KV.

Each step has a token budget (``max_num_batched_tokens``). Running sequences go first,
decodes before prefill chunks, so a long prompt never stalls token generation; then
waiting sequences are admitted while budget, slots and blocks last. A running sequence
that cannot get a block preempts the newest unscheduled running sequence (its blocks are
freed and it is requeued to recompute prompt + generated tokens).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from common.engine.block_manager import BlockManager
from common.engine.kv_connector import FinishedTransfers, KVConnectorBase
from common.engine.outputs import FinishReason
from common.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    """The step's work: ``seqs[i]`` computes ``num_new_tokens[i]`` tokens from its ``num_computed_tokens``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    has_prefill: bool = False  # some scheduled token is a prompt token (the producer saves KV)

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)
        self.has_prefill |= seq.num_computed_tokens < seq.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        connector: KVConnectorBase,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool,
        eos_token_ids: set[int],
    ):
        self.block_manager = block_manager
        self.connector = connector
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.parked: dict[str, Sequence] = {}
        self.held: dict[str, Sequence] = {}

    # ---- queues -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_schedulable_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_transfers(self) -> bool:
        return bool(self.parked or self.held)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return self.parked.get(request_id)

    # ---- scheduling ---------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        self._admit_waiting(batch, budget)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        decodes = [s for s in self.running if not s.is_prefill]
        prefills = [s for s in self.running if s.is_prefill]
        for seq in decodes + prefills:
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted as a victim earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if self._grow_or_preempt(seq, n, batch):
                batch.add(seq, n)
                budget -= n
        return budget

    def _grow_or_preempt(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Find blocks for ``n`` more tokens of ``seq``, preempting others; False if ``seq`` itself was preempted."""
        while not self.block_manager.ensure_capacity(seq.block_table, seq.num_computed_tokens + n):
            victim = next((s for s in reversed(self.running) if s is not seq and s not in batch.seqs), None)
            self._preempt(victim or seq)
            if victim is None:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.release(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self._wants_remote_kv(seq):
                if not self._park(seq):
                    return
                continue
            n = seq.num_uncomputed_tokens
            if n > budget:
                if not self.enable_chunked_prefill and batch:
                    return  # a whole prompt must fit; wait for a step of its own
                if self.enable_chunked_prefill:
                    n = budget
            if not self.block_manager.ensure_capacity(seq.block_table, seq.num_computed_tokens + n):
                return
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n

    def _wants_remote_kv(self, seq: Sequence) -> bool:
        if seq.external_kv_checked or seq.num_computed_tokens > 0:
            return False
        wants = self.connector.num_external_tokens(seq) > 0
        seq.external_kv_checked = not wants  # re-asked until parked: parking may wait for blocks
        return wants

    def _park(self, seq: Sequence) -> bool:
        """Allocate blocks for the whole prompt and wait for the peer to fill them."""
        if not self.block_manager.ensure_capacity(seq.block_table, seq.num_prompt_tokens):
            return False
        self.waiting.popleft()
        seq.external_kv_checked = True
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.parked[seq.request_id] = seq
        self.connector.on_blocks_allocated(seq, list(seq.block_table))
        return True

    # ---- after a step ---------------------------------------------------------------
    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Record a sampled token and finish the sequence when a stop condition holds."""
        seq.output_token_ids.append(token_id)
        reason = self._check_stop(seq, token_id)
        if reason is not None:
            self.finish(seq, reason)

    def _check_stop(self, seq: Sequence, token_id: int) -> FinishReason | None:
        params = seq.params
        if token_id in params.stop_token_ids:
            return "stop"
        if not params.ignore_eos and token_id in self.eos_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def process_transfers(self, finished: FinishedTransfers) -> list[Sequence]:
        """Apply the connector's finished transfers; returns the sequences that have news to emit."""
        touched = []
        for rid in finished.done_sending:
            seq = self.held.pop(rid, None)
            if seq is not None:
                self.block_manager.release(seq.block_table)
        for rid, first_token in finished.done_recving.items():
            seq = self.parked.pop(rid, None)
            if seq is None:
                continue
            seq.num_computed_tokens = seq.num_prompt_tokens
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)  # next decode step feeds first_token at position len(prompt)
            self.append_token(seq, first_token)
            touched.append(seq)
        for rid, message in finished.failed_recving.items():
            seq = self.parked.get(rid)
            if seq is not None:
                self.finish(seq, "error", error=message)
                touched.append(seq)
        return touched

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Take ``seq`` out of every queue; free its blocks unless the connector still sends them."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.parked.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        if self.connector.request_finished(seq) and seq.block_table:
            self.held[seq.request_id] = seq
        else:
            self.block_manager.release(seq.block_table)
