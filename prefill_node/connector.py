"""The producer connector: the engine's hooks on the prefill daemon, backed by the transfer engine.

For a tagged request (its id names a decode node) the engine runs prefill as usual;
after each layer of the pass that completes the prompt, ``save_kv_layer`` offers that
layer to the transfer engine, which pushes it only if the decode node has already
asked (else the KV stays in the paged blocks). Sampling the first token finishes the
request (max_tokens is 1 here); ``request_finished`` then hands it to the transfer
engine with ``finish`` (the lease starts; the rest of the KV and the first token go out
whenever the decode node asks) and keeps its blocks until the transfer engine reports
it freeable: acknowledged by the decode node, aborted, failed, or its lease expired.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from common.engine.kv_connector import FinishedTransfers, KVConnectorBase

if TYPE_CHECKING:
    from common.engine.sequence import Sequence
    from common.kv_transfer.engine import KVTransferEngine
    from common.model.attention_metadata import AttentionMetadata

logger = logging.getLogger(__name__)


def is_tagged(seq: Sequence) -> bool:
    return bool(seq.kv_transfer_params.get("decode_addr"))


class ProducerConnector(KVConnectorBase):
    """Bound to a transfer engine and the KV cache once the engine exists (``bind``)."""

    def __init__(self) -> None:
        self.transfer: KVTransferEngine | None = None
        self.kv_caches: list[torch.Tensor] = []
        self._handed_over: set[str] = set()  # finish() called; blocks held until freeable

    def bind(self, transfer: KVTransferEngine, kv_caches: list[torch.Tensor]) -> None:
        self.transfer, self.kv_caches = transfer, kv_caches

    def save_kv_layer(
        self, layer_idx: int, kv_layer: torch.Tensor, seqs: list[Sequence], attn_metadata: AttentionMetadata
    ) -> None:
        assert self.transfer is not None
        for seq, seq_len in zip(seqs, attn_metadata.seq_lens):
            # only the pass that completes the prompt: earlier chunks are sent from the blocks later
            if is_tagged(seq) and seq_len == seq.num_prompt_tokens:
                self.transfer.producer.save_layer(seq.request_id, layer_idx, kv_layer, seq.block_table)

    def request_finished(self, seq: Sequence) -> bool:
        """Hand a tagged request that sampled its first token to the transfer engine and hold
        its blocks; free the rest now."""
        if not is_tagged(seq) or self.transfer is None:
            return False
        rid = seq.request_id
        if seq.output_token_ids and seq.finish_reason in ("length", "stop"):
            self._handed_over.add(rid)
            logger.info("request %s: prefill done, KV held for %s (%d blocks)", rid,
                        seq.kv_transfer_params.get("decode_addr"), len(seq.block_table))
            self.transfer.producer.finish(
                rid, seq.output_token_ids[0], self.kv_caches, list(seq.block_table), seq.num_prompt_tokens
            )
            return True
        # ended before its first token (aborted, failed): nothing reads its blocks after the
        # layer pushes (those were copies), so they can go now; tell a waiting decode node
        why = f"prefill ended ({seq.finish_reason}) before the first token"
        logger.info("request %s: %s; KV dropped", rid, why)
        self.transfer.producer.discard(rid, why)
        return False

    def get_finished(self) -> FinishedTransfers:
        if self.transfer is None:
            return FinishedTransfers()
        freeable = self.transfer.producer.poll_freeable()
        self._handed_over -= freeable
        for rid in freeable:
            logger.info("request %s: KV released", rid)
        return FinishedTransfers(done_sending=freeable)
