"""Continuous batching: which sequences run this step and how many tokens each computes.

Queues: ``waiting`` (FIFO, new and preempted) -> ``running`` (at most ``max_num_seqs``)
-> finished. With a consumer connector a new sequence whose prompt KV comes from a peer
goes ``waiting`` -> ``parked`` (blocks for the whole prompt held, no running slot) and,
once the worker reports the KV landed with the first token, back to the front of
``waiting`` with its prompt marked computed (or, when no pair with the peer could be had,
back with nothing computed: a local prefill). A finished sequence whose blocks a KV transfer
still uses sits in ``blocks_lent`` until it lets go: the peer has read its KV (prefill), or
an aborted receive stopped writing (decode).

The scheduler side of the connector (``kv_connector``) is told what happens and makes the
transfer decisions; ``schedule`` attaches the step's ``KVConnectorMetadata`` to the batch
and ``take_kv_metadata`` hands over what a step's postprocess decided (a first token to
hand over). The scheduler never touches the KV endpoint or the network.

Each step has a token budget (``max_num_batched_tokens``). Running sequences go first,
decodes before prefill chunks, so a long prompt never stalls token generation; then
waiting sequences are admitted while budget, slots and blocks last. A running sequence
that cannot get a block preempts the newest unscheduled running sequence (its blocks are
freed and it is requeued to recompute prompt + generated tokens).

Prefix caching (when the block manager has it): a sequence admitted with nothing
computed starts on the longest run of cached full blocks of its tokens (held, not
copied) and computes only the rest; at least its last token is always computed, since
that yields the logits. A parked sequence does the same, and the connector asks the peer
only for the blocks after that prefix. Full blocks are registered in the cache once
their KV is computed (or landed), so later requests and recomputes can reuse them. A
request's ``cache_salt`` roots its hash chain apart, so it shares blocks only with the
same salt (on a decode node too: it asks the peer for every block its salt has not cached).

KV tiers (``kv_tiers``, when the engine has them): a sequence whose pool lookup stops short asks
the tiers for its next blocks and gets fresh blocks for what they hold. Host-tier blocks are copied
in at once; while the file tier reads, the sequence waits in ``loading`` (holding its blocks, no
running slot), and returns to the front of ``waiting`` with the leading blocks that loaded whole
marked computed and cached; the blocks after a failed one are freed and their tokens computed.
With the proxy's peer hint (``params.kv_peer``) the blocks after what the tiers hold, up to the
hint's count, come from that peer the same way (the peer tier).

Fair share (``fairness``, on unless ``fair_share=False``): admission takes the next sequence
from ``waiting`` by client, the least-served client first (FIFO within a client), and a client
over its cap of tokens in flight yields its newest running sequences to one under it. With one
client the order is the plain FIFO above.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.engine.block_hash import BlockHash, extend_hashes, root_hash, salted_root
from common.engine.block_manager import BlockManager
from common.engine.choices import FirstToken, new_choice
from common.engine.fairness import DEFAULT_MAX_TOKENS_IN_FLIGHT_PER_CLIENT, FairShare
from common.engine.kv_connector import (EMPTY_METADATA, FinishedTransfers, KVConnectorMetadata,
                                        KVConnectorScheduler)
from common.engine.outputs import FinishReason
from common.engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from common.engine.kv_tiers import KVTiers


@dataclass
class ScheduledBatch:
    """The step's work: ``seqs[i]`` computes ``num_new_tokens[i]`` tokens from its ``num_computed_tokens``."""

    seqs: list[Sequence] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    kv_connector_metadata: KVConnectorMetadata = EMPTY_METADATA  # what the connector's workers do this step

    def add(self, seq: Sequence, n: int) -> None:
        self.seqs.append(seq)
        self.num_new_tokens.append(n)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        connector: KVConnectorScheduler,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool,
        eos_token_ids: set[int],
        cache_root: BlockHash | None = None,
        fair_share: bool = True,
        max_tokens_in_flight_per_client: int = DEFAULT_MAX_TOKENS_IN_FLIGHT_PER_CLIENT,
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
        # finished requests whose blocks are lent to a KV transfer until it lets go of them: on a
        # prefill node, the send (until the peer has the KV: ``freeable``); on a decode node, an
        # aborted receive (until nothing writes into them: ``stopped``)
        self.blocks_lent: dict[str, Sequence] = {}
        # the hash chain's root names what changes a block's KV besides its tokens (the engine
        # passes the model identity); block size goes in here so no caller can forget it
        self.cache_root = root_hash(cache_root, block_manager.block_size)
        # received from a peer, not yet in the prefix cache: they join it only once the request
        # finishes normally (stop or length), so a failed or refused transfer leaves nothing named
        self._received: set[str] = set()
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache (vLLM's meaning)
        self.prefix_cache_hits = 0  # of those, tokens found cached
        self.forked: list[Sequence] = []  # choices forked since ``take_forked``
        self.block_copies: list[tuple[int, int]] = []  # (from, to): a forked choice's prompt tail block
        self.fairness = FairShare(max_tokens_in_flight_per_client, enabled=fair_share)
        self._newcomers_ran = False  # the last step was fair share's newcomers' alone
        self.tiers: KVTiers | None = None  # the engine's KV tiers, when configured
        self.loading: dict[str, Sequence] = {}  # waiting for their prefix's KV from the file tier

    # ---- queues -------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)
        self.fairness.arrived(seq)

    def has_schedulable_work(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_transfers(self) -> bool:
        return bool(self.parked or self.blocks_lent or self.loading)

    def find(self, request_id: str) -> Sequence | None:
        for seq in (*self.running, *self.waiting):
            if seq.request_id == request_id:
                return seq
        return self.parked.get(request_id) or self.loading.get(request_id)

    # ---- scheduling ---------------------------------------------------------------
    def schedule(self, stall_token_cap: int | None = None) -> ScheduledBatch:
        """The step's batch. ``stall_token_cap``: the most prompt tokens the step may carry when
        it also decodes (a local prefill is chunked so no decode waits longer than its bound)."""
        batch = ScheduledBatch()
        if self.tiers is not None:
            self._poll_tiers()
        for seq in self.running:  # KV computed by the last step is complete: share it
            self._cache_full_blocks(seq)
        self._make_room()
        if not self._newcomers_ran:  # fair share: their prompts first, in a step of their own
            newcomers = self.fairness.newcomers(self.waiting, self.running, self.max_num_seqs,
                                                self.max_num_batched_tokens)
            if newcomers:
                budget = min(self.max_num_batched_tokens, stall_token_cap or self.max_num_batched_tokens)
                self._admit_waiting(batch, budget, stall_token_cap, only=newcomers)
        self._newcomers_ran = bool(batch)  # the decodes it skipped run in the next step
        if not batch:
            budget = self._schedule_running(batch, self.max_num_batched_tokens, stall_token_cap)
            self._admit_waiting(batch, budget, stall_token_cap)
        batch.kv_connector_metadata = self.connector.build_meta(batch.seqs, batch.num_new_tokens)
        return batch

    def take_kv_metadata(self) -> KVConnectorMetadata:
        """What the connector decided since ``schedule`` (a step's postprocess, an abort)."""
        return self.connector.build_meta()

    def _schedule_running(self, batch: ScheduledBatch, budget: int, stall_token_cap: int | None) -> int:
        decodes = [s for s in self.running if not s.is_prefill]
        prefills = [s for s in self.running if s.is_prefill]
        for i, seq in enumerate(decodes + prefills):
            if i == len(decodes) and batch and stall_token_cap is not None:
                budget = min(budget, stall_token_cap)  # what is left goes to prompts: keep the step short
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:  # preempted as a victim earlier in this loop
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if self._grow_or_preempt(seq, n, batch):
                batch.add(seq, n)
                budget -= n
        if not prefills and batch and stall_token_cap is not None:
            budget = min(budget, stall_token_cap)  # waiting prompts admitted next share the bound
        return budget

    def _grow_or_preempt(self, seq: Sequence, n: int, batch: ScheduledBatch) -> bool:
        """Find blocks for ``n`` more tokens of ``seq``, preempting others; False if ``seq``
        itself was preempted."""
        while not self.block_manager.ensure_capacity(seq.block_table, seq.num_computed_tokens + n):
            victim = next((s for s in reversed(self.running) if s is not seq and s not in batch.seqs), None)
            self._preempt(victim or seq)
            if victim is None:
                return False
        return True

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _make_room(self) -> None:
        """Fair share: preempt the newest sequences of clients over their cap until the next
        admission, a client under its cap, has a slot and the blocks of its next chunk."""
        seq = self.fairness.needs_room(self.waiting, self.running)
        if seq is None:
            return
        bm, tokens = self.block_manager, seq.num_computed_tokens + min(seq.num_uncomputed_tokens,
                                                                       self.max_num_batched_tokens)
        while len(self.running) >= self.max_num_seqs or not bm.can_allocate(
                bm.blocks_needed(tokens) - len(seq.block_table)):
            victim = self.fairness.victim(self.running, seq)
            if victim is None:
                return
            self._preempt(victim)

    def _admit_waiting(self, batch: ScheduledBatch, budget: int, stall_token_cap: int | None = None,
                       only: list[Sequence] | None = None) -> None:
        """Admit waiting sequences in fair-share order (``only``: these, in their order) while the
        budget, the slots and the blocks last."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if only is not None and not only:
                return
            seq = self.fairness.pick(self.waiting, self.running) if only is None else only.pop(0)
            if self._wants_remote_kv(seq):
                if not self._park(seq, max(stall_token_cap or 0, self.block_manager.block_size)):
                    return
                continue
            took = self._take_cached_prefix(seq, seq.num_tokens)
            if took and self._load_from_tiers(seq):
                continue
            n = seq.num_uncomputed_tokens
            if n > budget and self.enable_chunked_prefill:
                n = budget
            if (n > budget and batch) or not self.block_manager.ensure_capacity(
                    seq.block_table, seq.num_computed_tokens + n):
                if took:  # give the cached blocks back; the lookup is redone next time
                    self._release(seq)
                return  # without chunking a whole prompt must fit: it waits for a step of its own
            if took:
                self._count_lookup(seq, seq.num_tokens)
                if not seq.num_preemptions:  # a recompute's hits are not the prompt's
                    seq.num_cached_tokens = seq.num_computed_tokens
            self._leave_waiting(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.add(seq, n)
            budget -= n

    def _leave_waiting(self, seq: Sequence) -> None:
        if self.waiting[0] is seq:
            self.waiting.popleft()
        else:
            self.waiting.remove(seq)
        self.fairness.admitted(seq)

    def _wants_remote_kv(self, seq: Sequence) -> bool:
        # a prefix just loaded from the KV tiers still leaves the rest to ask the peer for
        if seq.external_kv_checked or (seq.num_computed_tokens > 0 and not seq.tiers_checked):
            return False
        wants = self.connector.num_external_tokens(seq) > 0
        seq.external_kv_checked = not wants  # re-asked until parked: parking may wait for blocks
        return wants

    def _park(self, seq: Sequence, local_token_cap: int) -> bool:
        """Allocate blocks for the whole prompt and wait for the peer to fill them; blocks of a
        cached prefix are taken as they are (``num_computed_tokens`` says how many tokens).
        With KV tiers, the blocks after the pool's run are loaded from them
        first (``loading``); the sequence comes back here with that prefix. When the connector would
        rather compute the uncached rest here (at most
        ``local_token_cap`` tokens: one stall-bounded step), the sequence stays waiting, as a
        local prefill (the next pass admits it and looks its prefix up again)."""
        took = self._take_cached_prefix(seq, seq.num_prompt_tokens)
        if took and self._load_from_tiers(seq):
            return True  # back in ``waiting`` once loaded, it parks with that prefix (asks the peer for the rest)
        has_prefix = took or seq.num_computed_tokens > 0  # the pool's, or loaded from the tiers
        if has_prefix and self.connector.prefill_here(seq, seq.num_uncomputed_tokens, local_token_cap):
            self._release(seq)
            seq.external_kv_checked = True
            return True
        if not self.block_manager.ensure_capacity(seq.block_table, seq.num_prompt_tokens):
            if took:
                self._release(seq)  # a later try looks up again: what was cached may be gone
            return False
        if took:
            self._count_lookup(seq, seq.num_prompt_tokens)
        self._leave_waiting(seq)
        seq.external_kv_checked = True
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KV
        self.parked[seq.request_id] = seq
        self.connector.on_blocks_allocated(seq, seq.num_computed_tokens // self.block_manager.block_size)
        return True

    # ---- after a step ---------------------------------------------------------------
    def append_token(self, seq: Sequence, token_id: int) -> None:
        """Record a sampled token and finish the sequence when a stop condition holds."""
        seq.output_token_ids.append(token_id)
        self.fairness.served(seq.params.client, output_tokens=1)
        reason = self._check_stop(seq, token_id)
        if seq.grammar is not None and reason is None:  # a peer's first token advances it too
            if not seq.grammar.advance(token_id):
                self.finish(seq, "error", error=f"token {token_id} breaks the response format: {seq.grammar.error}")
                return
            reason = "stop" if seq.grammar.is_complete else None
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
        """Apply the workers' finished transfers; returns the sequences that have news to emit."""
        finished = self.connector.update_finished(finished)
        touched = []
        for rid in finished.freeable | finished.stopped:  # a peer done with them, or an aborted receive stopped
            seq = self.blocks_lent.pop(rid, None)
            if seq is not None:
                self.block_manager.release(seq.block_table)
        for rid, first_token in finished.done_recving.items():
            seq = self.parked.pop(rid, None)
            if seq is None:
                continue
            seq.num_computed_tokens = seq.num_prompt_tokens
            # the prompt was computed on the producer: its prefix-cache count is the one to report
            seq.num_cached_tokens = min(max(finished.cached_tokens.get(rid, 0), 0), seq.num_prompt_tokens)
            self._received.add(rid)  # cached when it finishes normally (finish)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)  # next decode step feeds first_token at position len(prompt)
            if seq.params.logprobs is not None and rid in finished.first_logprobs:
                seq.logprobs.append(finished.first_logprobs[rid])
            if seq.params.n > 1:  # before choice 0's token: if that ends it, its blocks are shared already
                self.fork(seq, finished.choice_firsts.get(rid, []))
            if not seq.is_finished:
                self.append_token(seq, first_token)
            touched.append(seq)
        for rid, reason in finished.prefill_here.items():  # no pair to be had: computed here instead
            seq = self.parked.pop(rid, None)
            if seq is not None:
                self._release(seq)  # nothing landed in its blocks; a local prefill looks its prefix up again
                seq.status = SequenceStatus.WAITING
                self.waiting.appendleft(seq)  # external_kv_checked stays set: it is never parked again
                self.connector.fall_back(seq, reason)
        for rid, message in finished.failed_recving.items():
            seq = self.parked.get(rid)
            if seq is not None:
                self.finish(seq, "error", error=message)
                touched.append(seq)
        return touched

    # ---- n > 1 (common/engine/choices.py) ------------------------------------------------
    def fork(self, parent: Sequence, firsts: list[FirstToken]) -> None:
        """Choices 1.. of ``parent`` (prompt computed, its own first token not yet appended), each
        with its first token; they share the prompt's blocks, the tail block copied (the engine
        applies ``block_copies`` before anything writes). A choice its first token ends holds none."""
        parent.choice_firsts = list(firsts)
        if len(firsts) != parent.params.n - 1:
            self.finish(parent, "error", error=f"{len(firsts) + 1} first tokens for n={parent.params.n} choices")
            return
        for index, first in enumerate(firsts, start=1):
            child = new_choice(parent, index, first)
            child.output_token_ids.append(first[0])
            if (reason := self._check_stop(child, first[0])) is not None:
                child.status, child.finish_reason = SequenceStatus.FINISHED, reason
            else:
                child.output_token_ids.pop()
                self._share_prompt_blocks(parent, child)
                self.waiting.appendleft(child)
                self.fairness.arrived(child)
                self.append_token(child, first[0])
            self.forked.append(child)

    def _share_prompt_blocks(self, parent: Sequence, child: Sequence) -> None:
        bm, bs = self.block_manager, self.block_manager.block_size
        num_full = parent.num_prompt_tokens // bs
        child.block_table = parent.block_table[:num_full]
        bm.fork(child.block_table)
        child.block_hashes = parent.block_hashes[:num_full]
        child.num_cached_blocks = min(parent.num_cached_blocks, num_full)
        if num_full * bs == parent.num_prompt_tokens:
            return
        if bm.can_allocate(1):
            child.block_table += bm.allocate(1)
            self.block_copies.append((parent.block_table[num_full], child.block_table[-1]))
        else:  # no block to copy into: it recomputes the tail, as a preempted sequence would
            child.num_computed_tokens = num_full * bs

    def take_forked(self) -> tuple[list[Sequence], list[tuple[int, int]]]:
        """The choices forked and the blocks to copy for them since the last call."""
        forked, copies = self.forked, self.block_copies
        self.forked, self.block_copies = [], []
        return forked, copies

    def finish(self, seq: Sequence, reason: FinishReason, error: str | None = None) -> None:
        """Take ``seq`` out of every queue; free its blocks unless the connector still sends them."""
        if seq.is_finished:
            return
        if seq.request_id in self._received:
            self._received.discard(seq.request_id)
            if reason in ("stop", "length"):
                self._cache_full_blocks(seq)
        else:
            self._cache_full_blocks(seq)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SequenceStatus.LOADING_KV:
            del self.loading[seq.request_id]
            self.tiers.cancel(seq.request_id)  # type: ignore[union-attr]
        else:
            self.parked.pop(seq.request_id, None)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.error = error
        self.fairness.left(seq)
        if self.tiers is not None and self.tiers.offload_on_finish:
            self.tiers.offload_many(seq.block_table[:seq.num_cached_blocks], seq.block_hashes[:seq.num_cached_blocks])
        if self.connector.request_finished(seq) and seq.block_table:
            self.blocks_lent[seq.request_id] = seq
        else:
            self.block_manager.release(seq.block_table)

    # ---- prefix caching ---------------------------------------------------------------
    def _take_cached_prefix(self, seq: Sequence, num_tokens: int) -> bool:
        """Start a sequence with nothing computed on the cached full blocks of its first
        ``num_tokens`` tokens, all but the last token at most. True when it looked."""
        bm = self.block_manager
        if not bm.enable_prefix_caching or seq.num_computed_tokens or seq.block_table:
            return False
        num_blocks = (num_tokens - 1) // bm.block_size
        extend_hashes(seq.block_hashes, self._root(seq), seq.token_ids, bm.block_size, num_blocks)
        seq.block_table.extend(bm.take_cached(seq.block_hashes[:num_blocks]))
        seq.num_cached_blocks = len(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_blocks * bm.block_size
        return True

    # ---- KV tiers (common/engine/kv_tiers.py) ---------------------------------------------
    def _load_from_tiers(self, seq: Sequence) -> bool:
        """After a pool lookup: the prefix blocks after the pooled ones that the tiers hold, into
        fresh blocks. True when ``seq`` now waits in ``loading`` for the file tier or a peer."""
        bm, tiers = self.block_manager, self.tiers
        if tiers is None or seq.tiers_checked:
            return False
        first = len(seq.block_table)
        hashes = seq.block_hashes[first:(seq.num_tokens - 1) // bm.block_size]
        peer = seq.params.kv_peer
        found = tiers.lookup(hashes, (peer[0], peer[1] - first) if peer else None) if hashes else None
        if not found or not bm.can_allocate(len(found)):
            return False
        blocks = bm.allocate(len(found))
        seq.block_table.extend(blocks)
        seq.tiers_checked = True
        filled = tiers.start_load(seq.request_id, hashes, found, blocks)
        if filled is not None:
            self._tier_loaded(seq, filled)
            return False
        self._leave_waiting(seq)
        seq.status = SequenceStatus.LOADING_KV
        self.loading[seq.request_id] = seq
        return True

    def _tier_loaded(self, seq: Sequence, filled: int) -> None:
        """``filled`` blocks after the pooled prefix hold their KV: computed and cached from now;
        the blocks after them (a load cut short) are freed, and their tokens computed."""
        keep = seq.num_cached_blocks + filled
        self.block_manager.free(seq.block_table[keep:])
        del seq.block_table[keep:]
        seq.num_computed_tokens = keep * self.block_manager.block_size
        self._cache_full_blocks(seq)

    def _poll_tiers(self) -> None:
        """Tier changes out as KV events; sequences whose file load finished back to ``waiting``."""
        tiers, bm = self.tiers, self.block_manager
        assert tiers is not None
        for rid, filled in tiers.poll():
            seq = self.loading.pop(rid, None)
            if seq is None:
                continue
            self._tier_loaded(seq, filled)
            self._count_lookup(seq, seq.num_tokens)
            if not seq.num_preemptions:
                seq.num_cached_tokens = seq.num_computed_tokens
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        for event in tiers.take_events():
            if bm.events is not None:
                bm.events(event)

    def _root(self, seq: Sequence) -> BlockHash:
        """Where ``seq``'s hash chain starts: its ``cache_salt`` keeps it apart from other salts."""
        return salted_root(self.cache_root, seq.params.cache_salt)

    def _count_lookup(self, seq: Sequence, num_tokens: int) -> None:
        self.prefix_cache_queries += num_tokens
        self.prefix_cache_hits += seq.num_computed_tokens

    def _cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks whose every token's KV is now in the cache."""
        bm = self.block_manager
        num_full = seq.num_computed_tokens // bm.block_size
        if not bm.enable_prefix_caching or num_full <= seq.num_cached_blocks or seq.request_id in self._received:
            return
        extend_hashes(seq.block_hashes, self._root(seq), seq.token_ids, bm.block_size, num_full)
        for i in range(seq.num_cached_blocks, num_full):
            tokens = tuple(seq.token_ids(i * bm.block_size, (i + 1) * bm.block_size)) if bm.events else ()
            bm.cache_block(seq.block_table[i], seq.block_hashes[i], seq.block_hashes[i - 1] if i else None, tokens)
        seq.num_cached_blocks = num_full

    def _release(self, seq: Sequence) -> None:
        """Free ``seq``'s blocks (cached ones stay reusable) and forget what it computed."""
        self.block_manager.release(seq.block_table)
        seq.num_computed_tokens = seq.num_cached_blocks = 0
