"""A recording connector worker: stands in for the KV endpoint in engine tests.

It keeps every metadata object it was given; a test makes transfers finish with
``land`` / ``fail`` / ``ack`` (reported at the next ``get_finished``). Aborted loads are
reported stopped at once, as a KV endpoint does once its receive has stopped.
"""

from __future__ import annotations

from common.engine.kv_connector import FinishedTransfers, KVConnector, KVConnectorMetadata, KVConnectorWorker
from decode_node.connector import ConsumerScheduler
from prefill_node.connector import ProducerScheduler


class RecordingWorker(KVConnectorWorker):
    def __init__(self) -> None:
        self.metas: list[KVConnectorMetadata] = []
        self.saved_layers: dict[str, list[int]] = {}  # request id -> layers saved, in order
        self.loads: dict[str, tuple[int, list[int]]] = {}  # request id -> (first block, block ids)
        self.handed_over: list[str] = []
        self.result = FinishedTransfers()

    def issue(self, meta: KVConnectorMetadata) -> None:
        self.metas.append(meta)
        for load in meta.loads:
            self.loads[load.request_id] = (load.first_block, list(load.block_ids))
        self.handed_over += [h.request_id for h in meta.handovers]
        self.result.stopped |= set(meta.aborts)

    def save_kv_layer(self, layer_idx, kv_layer, meta) -> None:
        for s in meta.saves:
            self.saved_layers.setdefault(s.request_id, []).append(layer_idx)

    def land(self, request_id: str, first_token: int, logprobs: dict[int, float] | None = None) -> None:
        self.result.done_recving[request_id] = first_token
        if logprobs is not None:
            self.result.first_logprobs[request_id] = logprobs

    def fail(self, request_id: str, error: str) -> None:
        self.result.failed_recving[request_id] = error

    def ack(self, request_id: str) -> None:
        self.result.freeable.add(request_id)

    def get_finished(self) -> FinishedTransfers:
        result, self.result = self.result, FinishedTransfers()
        return result


def consumer(worker: RecordingWorker | None = None) -> KVConnector:
    """The real consumer scheduler side over a recording worker."""
    return KVConnector(ConsumerScheduler(), worker or RecordingWorker())


def producer(worker: RecordingWorker | None = None) -> KVConnector:
    """The real producer scheduler side over a recording worker."""
    return KVConnector(ProducerScheduler(), worker or RecordingWorker())
