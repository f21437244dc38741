"""The worker halves of the two roles' connectors: the only halves bound to a KV endpoint
and a KV cache (``kv_connector``'s split). The scheduler halves live with their roles
(``prefill_node/connector.py``, ``decode_node/connector.py``); these live here so that the
tensor-parallel ranks (``tp_ranks``, ``tp_routes``, ``tp_slices``) can run them too.
"""

from __future__ import annotations

import torch

from common.engine.kv_connector import FinishedTransfers, KVConnectorMetadata, KVConnectorWorker, TransferWorker
from common.kv_transfer.config import TransferError
from common.kv_transfer.consumer import KVConsumer
from common.kv_transfer.producer import KVProducer


class ProducerWorker(TransferWorker):
    """Moves the bytes: the only half bound to the KV endpoint and the KV cache (``bind``)."""

    @property
    def producer(self) -> KVProducer:
        """The bound KV endpoint's producer half."""
        return self.transfer.producer

    def issue(self, meta: KVConnectorMetadata) -> None:
        if self.transfer is None:
            return
        producer = self.producer
        for d in meta.discards:
            producer.discard(d.request_id, d.why)
        for h in meta.handovers:
            logprobs = dict(h.first_logprobs) if h.first_logprobs is not None else None
            producer.finish(h.request_id, h.first_token, self.kv_caches, list(h.block_ids),
                            h.num_prompt_tokens, first_logprobs=logprobs,
                            choices=[[t, [list(p) for p in lp]] for t, lp in h.choices],
                            cached_tokens=h.num_cached_tokens)

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, meta: KVConnectorMetadata) -> None:
        if self.transfer is None:
            return
        for s in meta.saves:
            self.producer.save_layer(s.request_id, layer_idx, kv_layer, list(s.block_ids))

    def get_finished(self) -> FinishedTransfers:
        if self.transfer is None:
            return FinishedTransfers()
        return FinishedTransfers(freeable=self.producer.poll_freeable())


class ConsumerWorker(TransferWorker):
    """Moves the bytes: the only half bound to the KV endpoint and the KV cache (``bind``)."""

    @property
    def consumer(self) -> KVConsumer:
        """The bound KV endpoint's consumer half."""
        return self.transfer.consumer

    def issue(self, meta: KVConnectorMetadata) -> None:
        if self.transfer is None:
            return
        consumer = self.consumer
        for rid in meta.aborts:
            consumer.abort(rid)
        for rid, addr in meta.releases:  # as the pull would have, it may open the connection (known peers)
            consumer.release_remote(rid, addr)
        for load in meta.loads:
            try:
                consumer.request(load.request_id, load.prefill_addr, list(load.block_ids),
                                 load.num_prompt_tokens, self.kv_caches, first_block=load.first_block)
            except (ValueError, TransferError) as e:  # one bad load fails its request, not the engine
                consumer.refuse(load.request_id, str(e))

    def get_finished(self) -> FinishedTransfers:
        if self.transfer is None:
            return FinishedTransfers()
        consumer = self.consumer
        done, failed = consumer.poll_finished()
        landed = consumer.take_landed(done) if done else {}
        return FinishedTransfers(
            stopped=consumer.poll_aborted(), done_recving=done, failed_recving=failed,
            first_logprobs={rid: t.first_logprobs for rid, t in landed.items() if t.first_logprobs},
            choice_firsts={rid: t.choices for rid, t in landed.items() if t.choices},
            cached_tokens={rid: t.cached_tokens for rid, t in landed.items() if t.cached_tokens > 0})


def consumer_of(worker: KVConnectorWorker) -> KVConsumer:
    """A decode rank's consumer: its connector worker is a :class:`ConsumerWorker`."""
    assert isinstance(worker, ConsumerWorker), f"a {type(worker).__name__} pulls no KV"
    return worker.consumer
