"""A prefill node that presents more KV ranks than it has ranks (``--kv-ranks V``).

A decode rank reads whole KV ranks of the prefill node (``tp_routes``: a prefill rank's heads go
to one decode rank). For a decode node of a larger TP size than the prefill node's, the prefill
node cuts each rank's heads into ``k = V / tp_size`` equal slices and presents each as a KV rank
of its own: KV rank ``v = rank · k + j`` holds slice ``j`` of its rank's heads, at
``kv-port + v``, with an endpoint whose layout is the slice's and whose cache is a view of those
heads. A decode node of TP ``b`` with ``V = m · b`` reads ``m`` of them per rank; at ``V = b``,
one each: every decode rank gets exactly its heads, and no prefill rank sends a head twice.

Each KV rank is an ordinary one-rank producer: the prefill rank hands every finished prompt to
all of its KV ranks (each holds it under its own lease), saves each layer's slice to each, and
the blocks are freeable only when every one of its KV ranks released the request
(:class:`SlicedWorker`). The cost: ``V`` transfers per request instead of ``tp_size``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from common.engine.kv_connector import FinishedTransfers, KVConnectorMetadata, KVConnectorWorker
from common.kv_transfer.tp_outcomes import RankOutcomes

if TYPE_CHECKING:
    import torch

    from common.kv_layout import KVLayout
    from common.kv_transfer.workers import ProducerWorker


def slice_heads(num_heads: int, k: int, j: int) -> slice:
    """Slice ``j`` of ``k`` equal slices of a rank's ``num_heads`` KV heads."""
    width = num_heads // k
    return slice(j * width, (j + 1) * width)


def slice_layout(layout: KVLayout, k: int) -> KVLayout:
    """The layout of one of ``k`` slices of a rank's heads (``layout``)."""
    return dataclasses.replace(layout, num_kv_heads=layout.num_kv_heads // k)


def slice_caches(kv_caches: list[torch.Tensor], heads: slice) -> list[torch.Tensor]:
    """Views of the rank's per-layer caches at ``heads`` (``[2, blocks, block_size, heads, head_dim]``)."""
    return [c[:, :, :, heads] for c in kv_caches]


class SlicedWorker(KVConnectorWorker):
    """One prefill rank's connector worker over its ``k`` KV ranks: ``workers[j]`` (bound to KV
    rank j's endpoint and to the view of slice j) gets every decision, each layer's slice, and
    a request is freeable once every one of them released it.

    ``workers[0]``'s table is the one the caller keeps (rank 0: the scheduler's; a worker rank:
    its follower's), so only the others' hand-overs and forgets are done here. Likewise its
    producer's ``is_member`` (the keyless pair-slot priority), which the caller sets: the others ask it."""

    def __init__(self, workers: list[ProducerWorker], num_heads: int) -> None:
        self.workers = workers
        first = workers[0].producer
        for worker in workers[1:]:  # asked at each handshake: whatever the caller set by then
            worker.producer.is_member = lambda consumer: first.is_member(consumer)
        self.heads = [slice_heads(num_heads, len(workers), j) for j in range(len(workers))]
        self.outcomes = RankOutcomes(len(workers))  # a hand-over is freeable once every KV rank released it

    @property
    def transfer(self):
        """The first KV rank's endpoint (what a rank's one endpoint would be)."""
        return self.workers[0].transfer

    def issue(self, meta: KVConnectorMetadata) -> None:
        for h in meta.handovers:
            self.outcomes.expect_release(h.request_id)
        for j, worker in enumerate(self.workers):
            if j:
                for h in meta.handovers:
                    worker.producer.table.hand_over(h.request_id)
            worker.issue(meta)

    def save_kv_layer(self, layer_idx: int, kv_layer: torch.Tensor, meta: KVConnectorMetadata) -> None:
        for worker, heads in zip(self.workers, self.heads):
            worker.save_kv_layer(layer_idx, kv_layer[:, :, :, heads], meta)

    def get_finished(self) -> FinishedTransfers:
        reports = []
        for j, worker in enumerate(self.workers):
            freeable = worker.get_finished().freeable
            if j:
                worker.producer.table.forget(freeable)
            reports.append(FinishedTransfers(freeable=freeable))
        return self.outcomes.combine(reports)[0]

    def close(self) -> None:
        """The extra KV ranks' endpoints (the first one's belongs to the caller)."""
        for worker in self.workers[1:]:
            worker.transfer.close()
