"""Hooks that let a KV transfer plug into the engine (vLLM v1's connector split).

The engine owns one connector. Role ``both`` uses :class:`NoKVConnector` (no transfer).
The prefill daemon's producer and the decode daemon's consumer subclass
:class:`KVConnectorBase`. Every hook is called on the engine's own thread.

Scheduler side
  * ``num_external_tokens(seq)``: prompt tokens whose KV arrives from a peer. When it is
    > 0 the scheduler allocates blocks for the whole prompt, calls
    ``on_blocks_allocated`` and parks the sequence (holding blocks, not a running slot)
    until ``get_finished`` reports it received.
  * ``request_finished(seq)``: called when a sequence finishes or is aborted; returning
    True means "keep its blocks until ``get_finished`` lists it in done_sending".

Worker side
  * ``save_kv_layer(layer_idx, kv_layer, seqs, attn_metadata)``: after each attention
    layer of a forward pass that contains prefill tokens (producer).
  * ``get_finished()``: polled once per engine step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from common.model.attention_metadata import AttentionMetadata


@dataclass
class FinishedTransfers:
    # producer: requests whose KV the peer acknowledged (or whose lease expired): free blocks now
    done_sending: set[str] = field(default_factory=set)
    # consumer: requests whose whole prompt KV landed: request_id -> first token id from the producer
    done_recving: dict[str, int] = field(default_factory=dict)
    # consumer: requests whose transfer failed: request_id -> error message (request fails, blocks freed)
    failed_recving: dict[str, str] = field(default_factory=dict)


class KVConnectorBase:
    """No-op hooks; a subclass overrides what its role needs."""

    def num_external_tokens(self, seq: Any) -> int:
        return 0

    def on_blocks_allocated(self, seq: Any, block_ids: list[int]) -> None:
        pass

    def save_kv_layer(
        self, layer_idx: int, kv_layer: torch.Tensor, seqs: list[Any], attn_metadata: AttentionMetadata
    ) -> None:
        pass

    def on_step_done(self, seqs: list[Any]) -> None:
        """After sampling: ``seqs`` were in the step (their new token is appended)."""

    def request_finished(self, seq: Any) -> bool:
        return False

    def get_finished(self) -> FinishedTransfers:
        return FinishedTransfers()

    def close(self) -> None:
        pass


NoKVConnector = KVConnectorBase
