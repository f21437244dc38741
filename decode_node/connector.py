"""The consumer connector: the engine's hooks on the decode daemon, backed by the transfer engine.

For a tagged request (its id names a prefill node) the scheduler allocates blocks for
the whole prompt and parks the request (blocks held, no running slot); ``on_blocks_allocated``
asks the prefill node for the KV, which lands straight in those blocks. ``get_finished``
reports the landed requests with the prefill node's first token (the engine appends
it and decodes on: no recompute of the last prompt token) and the failed ones (the
request ends with an error and its blocks are freed).

A request aborted while its KV is still arriving (client gone, timeout) must not free
its blocks at once: the receiving thread could still be writing into them. Its blocks
are held until the transfer engine confirms the transfer has stopped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from common.engine.kv_connector import FinishedTransfers, KVConnectorBase

if TYPE_CHECKING:
    from common.engine.sequence import Sequence
    from common.kv_transfer.engine import KVTransferEngine

logger = logging.getLogger(__name__)


def prefill_addr(seq: Sequence) -> str | None:
    return seq.kv_transfer_params.get("prefill_addr")


class ConsumerConnector(KVConnectorBase):
    """Bound to a transfer engine and the KV cache once the engine exists (``bind``)."""

    def __init__(self) -> None:
        self.transfer: KVTransferEngine | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._in_flight: set[str] = set()
        self._aborting: set[str] = set()

    def bind(self, transfer: KVTransferEngine, kv_caches: list[torch.Tensor]) -> None:
        self.transfer, self.kv_caches = transfer, kv_caches

    def num_external_tokens(self, seq: Sequence) -> int:
        return seq.num_prompt_tokens if prefill_addr(seq) else 0

    def on_blocks_allocated(self, seq: Sequence, block_ids: list[int]) -> None:
        assert self.transfer is not None
        addr = prefill_addr(seq)
        assert addr is not None
        self._in_flight.add(seq.request_id)
        logger.info("request %s: %d blocks allocated, asking %s for %d tokens of KV", seq.request_id,
                    len(block_ids), addr, seq.num_prompt_tokens)
        self.transfer.consumer.request(seq.request_id, addr, block_ids, seq.num_prompt_tokens, self.kv_caches)

    def request_finished(self, seq: Sequence) -> bool:
        rid = seq.request_id
        if rid not in self._in_flight:
            return False
        assert self.transfer is not None
        self._in_flight.discard(rid)
        self._aborting.add(rid)
        logger.info("request %s: aborted while its KV was arriving; blocks held until the receive stops", rid)
        self.transfer.consumer.abort(rid)
        return True  # held until the transfer engine confirms nothing writes into the blocks

    def get_finished(self) -> FinishedTransfers:
        if self.transfer is None:
            return FinishedTransfers()
        done, failed = self.transfer.consumer.poll_finished()
        stopped = self.transfer.consumer.poll_aborted() & self._aborting
        self._aborting -= stopped
        done = {rid: tok for rid, tok in done.items() if rid in self._in_flight}
        failed = {rid: err for rid, err in failed.items() if rid in self._in_flight}
        self._in_flight -= done.keys() | failed.keys()
        for rid in done:
            logger.info("request %s: KV received, decoding", rid)
        for rid, err in failed.items():
            logger.warning("request %s: KV transfer failed: %s", rid, err)
        return FinishedTransfers(done_sending=stopped, done_recving=done, failed_recving=failed)
