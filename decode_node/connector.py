"""The consumer connector: the decode daemon's two connector halves.

A tagged request's life here (its id names a prefill node), by its one record in the
consumer's table (:class:`~common.kv_transfer.consumer_table.ConsumerTable`, shared with
the KV endpoint at ``bind``; the states are
:class:`~common.kv_transfer.consumer_table.ConsumerState`'s):

1. **LOAD_PENDING** — the scheduler allocated blocks for the whole prompt and parked the
   request (blocks held, no running slot). Blocks of a prefix this node already has cached
   are taken as they are; the ``LoadSpec`` asks only for the blocks after them
   (``first_block``; the prefill node still computes what it lacks itself).
2. **LOADING** — the load went out in the step's metadata; the worker asked the transfer
   engine (QUEUED, PULLED, RECEIVING), and the KV lands straight in the blocks. The worker
   reports the landed request with the prefill node's first token (and its logprobs): the
   engine appends it and decodes on, no recompute of the last prompt token. A failed
   transfer ends the request with an error and frees its blocks.
3. **ABORTING** — aborted (client gone, timeout) while the KV may still land: the receiving
   thread could still be writing into the blocks, so they are held until the worker reports
   the receive stopped. Aborted while LOAD_PENDING (not yet handed to the worker), the load
   is dropped and the blocks are freed at once.

**Override** (adaptive disaggregation): the proxy tags a request remote from an estimate of
what this node caches; the scheduler knows it exactly. When the prompt is mostly cached here
(no fewer tokens cached than left) and its uncached part fits one stall-bounded step
(``--max-local-prefill-stall-ms`` at the measured rate, at least one block) it is computed here, like a local prefill: no entry in the table, no load; the worker
tells the prefill node to drop the request's KV (an ABORT, as for a refused request; the
prefill node frees it once its prefill ends, and its leg still answers the proxy). Counted by
reason in ``overrides`` (``pdserve:decode_prefill_overrides_total``).

**Fallback**: a request whose prefill node gave no pair (it refused the handshake: at its
``--kv-max-pairs``, reason ``pairs_full``, or for another reason, ``pair_refused``) asked for
nothing and nothing landed in its blocks: it goes back to the scheduler's waiting queue and is
computed here, the prefill node is told to drop its KV, and ``overrides`` counts it by that
reason. The client sees a slower first token, never a 502. The other way round
there is no override: a request tagged local has no prefill leg, so it is prefilled here even
when its prompt is long or blocks are short: in stall-bounded chunks, waiting for blocks like
any prompt.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from common.engine.kv_connector import (FinishedTransfers, KVConnector, KVConnectorMetadata,
                                        KVConnectorScheduler, LoadSpec)
from common.kv_transfer.config import no_pair_reason
from common.kv_transfer.consumer_table import ConsumerState, ConsumerTable
from common.kv_transfer.workers import ConsumerWorker

if TYPE_CHECKING:
    import torch

    from common.engine.sequence import Sequence
    from common.kv_transfer.endpoint import KVEndpoint

logger = logging.getLogger(__name__)


def prefill_addr(seq: Sequence) -> str | None:
    return seq.kv_transfer_params.get("prefill_addr") or None


class ConsumerScheduler(KVConnectorScheduler):
    """Decides which requests load which blocks from which peer; holds no KV endpoint."""

    def __init__(self, overrides: collections.Counter[str] | None = None) -> None:
        super().__init__()
        # reason -> remote tags computed here (one counter across a node's role flips)
        self.overrides: collections.Counter[str] = collections.Counter() if overrides is None else overrides
        self.table = ConsumerTable()  # until bind: then the KV endpoint's (one table a side)
        # tensor parallelism: another rank may still write into a request's blocks (tp_ranks)
        self.still_landing: Callable[[str], bool] = lambda request_id: False
        # the prefill node's TP size, as the registry last said (0: unknown; common/node/daemon.py)
        self.peer_tp_size: Callable[[str], int] = lambda prefill_addr: 0

    def state(self, request_id: str) -> ConsumerState | None:
        return self.table.state(request_id)

    def num_external_tokens(self, seq: Sequence) -> int:
        return seq.num_prompt_tokens if prefill_addr(seq) else 0

    def prefill_here(self, seq: Sequence, num_uncached: int, max_tokens: int) -> bool:
        addr = prefill_addr(seq)
        # mostly cached, not merely short: a short uncached prompt is the proxy's call (`always` stays always)
        if addr is None or num_uncached > max_tokens or seq.num_computed_tokens < num_uncached:
            return False
        self.overrides["cached"] += 1
        self._releases.append((seq.request_id, addr))
        logger.debug("request %s: override to a local prefill (cached): %d of %d prompt tokens cached here, "
                     "%d to compute (one step holds %d); telling %s to drop its KV", seq.request_id,
                     seq.num_prompt_tokens - num_uncached, seq.num_prompt_tokens, num_uncached, max_tokens, addr)
        return True

    def on_blocks_allocated(self, seq: Sequence, first_block: int) -> None:
        addr = prefill_addr(seq)
        assert addr is not None
        self.table.load_pending(seq.request_id)
        self._loads.append(LoadSpec(seq.request_id, addr, tuple(seq.block_table[first_block:]), first_block,
                                    seq.num_prompt_tokens, self.peer_tp_size(addr)))
        logger.info("request %s: %d blocks allocated (%d cached), asking %s for %d tokens of KV",
                    seq.request_id, len(seq.block_table), first_block, addr, seq.num_uncomputed_tokens)

    def request_finished(self, seq: Sequence) -> bool:
        rid = seq.request_id
        if self.table.cancel_pending(rid):  # the worker never heard of it: nothing writes there
            self._loads = [load for load in self._loads if load.request_id != rid]
            return False
        if not (self.table.abort(rid) or self.still_landing(rid)):  # landed, failed or never loaded: nothing lands
            return False
        self._aborts.append(rid)
        logger.info("request %s: aborted while its KV was arriving; blocks held until the receive stops", rid)
        return True

    def build_meta(self, seqs: list[Sequence] | None = None,
                   num_new_tokens: list[int] | None = None) -> KVConnectorMetadata:
        for load in self._loads:
            self.table.issue(load.request_id)
        return super().build_meta(seqs, num_new_tokens)

    def update_finished(self, finished: FinishedTransfers) -> FinishedTransfers:
        """The worker's report: the table already ignored a landing or failure that raced an
        abort, and the scheduler applies it only to what it still parks or holds. A failure
        because no pair could be had is no failure of the request: it is computed here."""
        for rid in finished.done_recving:
            logger.info("request %s: KV received, decoding", rid)
        for rid, err in list(finished.failed_recving.items()):
            if (reason := no_pair_reason(err)) is not None:
                del finished.failed_recving[rid]
                finished.prefill_here[rid] = reason
                logger.warning("request %s: %s; computing its prompt here", rid, err)
            else:
                logger.warning("request %s: KV transfer failed: %s", rid, err)
        self.table.forget((*finished.done_recving, *finished.failed_recving, *finished.prefill_here),
                          finished.stopped)
        return finished

    def fall_back(self, seq: Sequence, reason: str) -> None:
        addr = prefill_addr(seq)
        self.overrides[reason] += 1
        if addr is not None:  # its prefill leg may still run there: its KV is dropped, not leased
            self._releases.append((seq.request_id, addr))


class ConsumerConnector(KVConnector):
    """Both halves; the daemon binds the worker to its KV endpoint once that exists."""

    def __init__(self, overrides: collections.Counter[str] | None = None) -> None:
        super().__init__(ConsumerScheduler(overrides), ConsumerWorker())

    def bind(self, transfer: KVEndpoint, kv_caches: list[torch.Tensor]) -> None:
        """The worker gets the KV endpoint; the scheduler side reads the engine's table."""
        super().bind(transfer, kv_caches)
        assert isinstance(self.scheduler, ConsumerScheduler) and not self.scheduler.table
        self.scheduler.table = transfer.consumer.table
