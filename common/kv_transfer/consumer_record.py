"""The consumer's one record per transfer and its one state enum.

:class:`~common.kv_transfer.consumer.KVConsumer` owns the records (its table) and makes
every state change; its module docstring has the table of transitions. A link thread
(receiver.py) keeps references to the records it works on, never copies of their state.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from common.kv_transfer.verify import new_nonce

if TYPE_CHECKING:
    from common.kv_transfer.receiver import PairReceiver


class TransferState(enum.Enum):
    """Where a transfer is on the consumer; see the table in consumer.py."""

    QUEUED = "queued"  # handed to the link thread; handshake (if no pair yet) and PULL next
    PULLED = "pulled"  # PULL sent: waiting for the producer's first layer
    RECEIVING = "receiving"  # layers landing in the blocks; DONE finishes it
    LANDED = "finished"  # every layer and DONE in and checked: the first token waits for a poll
    REPORTED = "reported"  # the first token was polled; its logprobs, choices, cached count wait for take_landed
    FAILED = "failed"  # ended with an error that waits for a poll
    ABORTING = "aborting"  # aborted while the link may still receive into its blocks
    STOPPED = "stopped"  # aborted and nothing writes into its blocks any more: waits for a poll

    @property
    def live(self) -> bool:
        """The link thread still works on it."""
        return self in (TransferState.QUEUED, TransferState.PULLED, TransferState.RECEIVING)


@dataclass
class Transfer:
    request_id: str
    block_ids: list[int]  # where blocks first_block.. of the prompt land
    num_tokens: int
    kv_caches: list[torch.Tensor]
    first_block: int = 0
    state: TransferState = TransferState.QUEUED  # changed by the owner (KVConsumer) only
    link: PairReceiver | None = None  # the thread that receives it
    started: float = field(default_factory=time.monotonic)
    first_byte: float | None = None  # its first layer arrived: the transfer rate runs from here to DONE
    layers: set[int] = field(default_factory=set)
    nbytes: int = 0
    retried: bool = False  # asked again on a new pair after the producer forgot the old one
    nonce: int = field(default_factory=new_nonce)  # in PULL; DONE must echo it (verify.py)
    checksums: dict[int, int] = field(default_factory=dict)  # layer -> CRC-32 of what landed (checksummed pairs)
    # what DONE brought (LANDED), or why it failed (FAILED)
    first_token: int = 0
    first_logprobs: dict[int, float] | None = None
    choices: list[tuple[int, dict[int, float] | None]] = field(default_factory=list)  # n > 1: choices 1..
    cached_tokens: int = 0  # prompt tokens the producer served from its prefix cache
    error: str = ""
