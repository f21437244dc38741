"""The producer connector: the prefill daemon's two connector halves.

A tagged request's life here (its id names a decode node):

1. **prefill** — the engine schedules it like any request (chunked when long). For the
   pass that completes the prompt the scheduler side puts a ``SaveSpec`` (row, decode
   node, block table) in the step's metadata; after each layer the worker
   offers that layer to the KV endpoint, which pushes it only if the decode node has
   already asked (else the KV stays in the paged blocks).
2. **hand-over** — sampling the first token finishes the request (max_tokens is 1 here).
   The scheduler side marks its record HANDED_OVER in the producer's one table
   (:class:`~common.kv_transfer.producer_table.ProducerTable`, shared with the transfer
   engine at ``bind``), records a ``HandoverSpec`` (first token, its logprobs, blocks) and
   holds the blocks; the engine issues it to the worker at the end of that same step, which
   calls the KV endpoint's ``finish`` (HELD: the lease starts; the rest of the KV and the
   first token go out whenever the decode node asks: SENDING, AWAITING_ACK).
3. **release** — the worker reports the request freeable (RELEASED: acknowledged by the
   decode node, aborted, failed, or its lease expired); the scheduler frees the blocks.

A request that ends before its first token (aborted, failed) is discarded: its blocks are
freed at once (no layer was pushed: that happens only in the pass that samples) and the
worker tells a decode node that already asked. With prefix caching the engine computes
only the tokens after its cached prefix; the blocks sent still start where the decode
node's own cache ends (cached blocks included).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from common.engine.kv_connector import (DiscardSpec, FinishedTransfers, HandoverSpec,
                                        KVConnector, KVConnectorScheduler, SaveSpec)
from common.kv_transfer.producer_table import ProducerState, ProducerTable
from common.kv_transfer.workers import ProducerWorker

if TYPE_CHECKING:
    from common.engine.sequence import Sequence
    from common.kv_transfer.endpoint import KVEndpoint

logger = logging.getLogger(__name__)


def decode_addr(seq: Sequence) -> str | None:
    return seq.kv_transfer_params.get("decode_addr") or None


class ProducerScheduler(KVConnectorScheduler):
    """Decides what the prefill node saves, hands over and discards; holds no KV endpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.table = ProducerTable()  # until bind: then the KV endpoint's (one table a side)

    def state(self, request_id: str) -> ProducerState | None:
        return self.table.state(request_id)

    def saves(self, seqs: list[Sequence], num_new_tokens: list[int]) -> list[SaveSpec]:
        out = []
        for row, (seq, n) in enumerate(zip(seqs, num_new_tokens)):
            addr = decode_addr(seq)
            # only the pass that completes the prompt: earlier chunks are sent from the blocks later
            if addr and seq.num_computed_tokens + n == seq.num_prompt_tokens:
                out.append(SaveSpec(seq.request_id, row, addr, tuple(seq.block_table), seq.num_prompt_tokens))
        return out

    def request_finished(self, seq: Sequence) -> bool:
        """Hand a tagged request that sampled its first token over and hold its blocks;
        discard the others (blocks freed now)."""
        addr = decode_addr(seq)
        if addr is None:
            return False
        rid = seq.request_id
        if seq.output_token_ids and seq.finish_reason in ("length", "stop"):
            self.table.hand_over(rid)
            logprobs = tuple(seq.logprobs[0].items()) if seq.logprobs else None
            choices = tuple((t, tuple((lp or {}).items())) for t, lp in seq.choice_firsts)  # n > 1
            self._handovers.append(HandoverSpec(rid, addr, seq.output_token_ids[0], logprobs,
                                                tuple(seq.block_table), seq.num_prompt_tokens, choices,
                                                seq.num_cached_tokens))
            logger.info("request %s: prefill done, KV held for %s (%d blocks)", rid, addr,
                        len(seq.block_table))
            return True
        why = f"prefill ended ({seq.finish_reason}) before the first token"
        logger.info("request %s: %s; KV dropped", rid, why)
        self._discards.append(DiscardSpec(rid, why))
        return False

    def update_finished(self, finished: FinishedTransfers) -> FinishedTransfers:
        """The worker's report as it is: the scheduler frees only what it still holds."""
        for rid in finished.freeable:
            logger.info("request %s: KV released", rid)
        self.table.forget(finished.freeable)
        return finished


class ProducerConnector(KVConnector):
    """Both halves; the daemon binds the worker to its KV endpoint once that exists."""

    def __init__(self) -> None:
        super().__init__(ProducerScheduler(), ProducerWorker())

    def bind(self, transfer: KVEndpoint, kv_caches: list[torch.Tensor]) -> None:
        """The worker gets the KV endpoint; the scheduler side reads the engine's table."""
        super().bind(transfer, kv_caches)
        assert isinstance(self.scheduler, ProducerScheduler) and not self.scheduler.table
        self.scheduler.table = transfer.producer.table
