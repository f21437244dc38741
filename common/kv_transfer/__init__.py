"""Moving one request's KV cache, layer by layer, from a prefill to a decode process.

``KVEndpoint`` is the entry point (one per daemon process): ``engine.producer``
on the prefill node, ``engine.consumer`` on the decode node. See ARCHITECTURE.md
("KV transfer") for the contract.
"""

from common.kv_transfer.config import (
    PairBrokenError,
    TransferConfig,
    TransferError,
    TransferStats,
)
from common.kv_transfer.endpoint import KVEndpoint

__all__ = [
    "KVEndpoint",
    "PairBrokenError",
    "TransferConfig",
    "TransferError",
    "TransferStats",
]
