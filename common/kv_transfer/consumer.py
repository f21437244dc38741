"""Consumer side (decode node): ask a producer for a request's KV and land it in blocks.

A request's life here: ``request`` (engine thread) registers it and hands it to the
producer's :class:`~common.kv_transfer.receiver.PairReceiver` thread, which makes sure a
pair exists (handshake: layout check, transport choice, pair build), sends PULL, then for
each LAYER notice receives the bytes into ``kv_caches[layer][:, block_ids]`` (tcp: straight
into the blocks; gloo/nccl: through a staging buffer unless the blocks are one run;
cuda_ipc: the producer already wrote them). DONE carries the first
token; the link ACKs and the request shows up in ``poll_finished``. A dead producer
(failed receive, unanswered ping), an error from the producer or ``abort`` end it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from common.kv_layout import KVLayout
from common.kv_transfer.config import TransferConfig, TransferError, TransferStats
from common.kv_transfer.messages import Abort, Message
from common.kv_transfer.receiver import PairReceiver, Transfer

if TYPE_CHECKING:
    from common.kv_transfer.control import ControlPlane

logger = logging.getLogger(__name__)


class KVConsumer:
    """The consumer half of :class:`~common.kv_transfer.engine.KVTransferEngine`."""

    def __init__(self, layout: KVLayout, config: TransferConfig, stats: TransferStats,
                 transport: str = "auto", vocab_size: int | None = None) -> None:
        self.layout, self.config, self.stats = layout, config, stats
        self.vocab_size = vocab_size  # a DONE's tokens must lie in [0, vocab_size) (peer_checks.py)
        # whether KV may be pulled from this producer address; the decode daemon sets it from
        # --kv-peers and the registry's member list (pdserve/daemon.py). Asked before anything opens.
        self.known_peer: Callable[[str], bool] = lambda address: True
        self.transport = transport  # --kv-transport: what this side asks for at each handshake
        self.control: ControlPlane  # set by the engine once bound
        self._lock = threading.Lock()
        self._links: dict[str, PairReceiver] = {}
        self._owner_of: dict[str, PairReceiver] = {}
        self._finished: dict[str, int] = {}
        self._first_logprobs: dict[str, dict[int, float]] = {}  # until the connector takes them
        self._choices: dict[str, list[tuple[int, dict[int, float] | None]]] = {}  # n > 1: likewise
        self._cached_tokens: dict[str, int] = {}  # DONE's prefix-cache count: likewise
        self._failed: dict[str, str] = {}
        self._aborted: set[str] = set()
        self._closed = False
        # called (from a link thread, without our lock) when a poll would return something new
        self.on_progress: Callable[[], None] = lambda: None

    def request(self, request_id: str, prefill_addr: str, block_ids: list[int], num_tokens: int,
                kv_caches: list[torch.Tensor], first_block: int = 0) -> None:
        """Ask the producer at ``prefill_addr`` ("host:port") for ``request_id``'s KV of a
        ``num_tokens``-token prompt from block ``first_block`` on (the blocks before it are
        already here) and land it in ``kv_caches[layer][:, block_ids]``. Returns at once; see
        :meth:`poll_finished`."""
        if len(kv_caches) != self.layout.num_layers:
            raise ValueError(f"{len(kv_caches)} KV layers, layout says {self.layout.num_layers}")
        if not 0 <= first_block < self._num_blocks(num_tokens):
            raise ValueError(f"first block {first_block} is outside a {num_tokens}-token prompt")
        if len(block_ids) < self._num_blocks(num_tokens) - first_block:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_tokens} tokens "
                             f"from block {first_block}")
        t = Transfer(request_id, list(block_ids), num_tokens, kv_caches, first_block)
        if not self.known_peer(prefill_addr):  # nothing is opened, nothing lands in the blocks
            self.stats.add(failures=1)
            with self._lock:
                self._failed[request_id] = (f"{prefill_addr} is not a known prefill node (not in --kv-peers "
                                            "nor registered with the proxy); not asking it for KV")
            self.on_progress()
            return
        with self._lock:
            if self._closed:
                raise TransferError("transfer engine closed")
            link = self._links.get(prefill_addr)
            if link is None and len(self._links) >= self.config.max_peers:
                # one thread per producer: ids naming ever new addresses must not grow them without bound
                self.stats.add(failures=1)
                self._failed[request_id] = (f"{self.config.max_peers} producers already in use; "
                                            f"not asking {prefill_addr}")
                self.on_progress()
                return
            if link is None:
                link = self._links[prefill_addr] = PairReceiver(self, prefill_addr)
            self._owner_of[request_id] = link
            link.events.put(("new", t))  # under the lock: an idle link retires only with an empty queue

    def poll_finished(self) -> tuple[dict[str, int], dict[str, str]]:
        """(request_id -> first token for landed transfers, request_id -> error for failed ones)."""
        with self._lock:
            done, failed = self._finished, self._failed
            self._finished, self._failed = {}, {}
        return done, failed

    def take_first_logprobs(self, request_ids: set[str] | dict) -> dict[str, dict[int, float]]:
        """The first token's logprobs that came with DONE, for these landed requests (taken once)."""
        with self._lock:
            return {rid: lp for rid in request_ids if (lp := self._first_logprobs.pop(rid, None)) is not None}

    def take_choices(self, request_ids: set[str] | dict) -> dict[str, list[tuple[int, dict[int, float] | None]]]:
        """Choices 1..'s first tokens that came with DONE (n > 1), for these landed requests (taken once)."""
        with self._lock:
            return {rid: c for rid in request_ids if (c := self._choices.pop(rid, None)) is not None}

    def take_cached_tokens(self, request_ids: set[str] | dict) -> dict[str, int]:
        """The producer's prefix-cache count of the prompt that came with DONE (taken once)."""
        with self._lock:
            return {rid: n for rid in request_ids if (n := self._cached_tokens.pop(rid, None)) is not None}

    def abort(self, request_id: str) -> None:
        """Stop waiting for ``request_id`` and tell its producer to drop it. Its blocks may be
        reused once :meth:`poll_aborted` names it (a receive into them may still be running)."""
        with self._lock:
            link = self._owner_of.pop(request_id, None)
            self._finished.pop(request_id, None)
            self._first_logprobs.pop(request_id, None)
            self._choices.pop(request_id, None)
            self._cached_tokens.pop(request_id, None)
            self._failed.pop(request_id, None)
            if link is None:
                self._aborted.add(request_id)
        if link is not None:
            link.events.put(("abort", request_id))

    def release_remote(self, request_id: str, prefill_addr: str, connect: bool = True) -> None:
        """Tell the producer at ``prefill_addr`` to drop ``request_id`` that this side will never
        ask for (e.g. the decode node refused the request): its KV is freed now, not at lease end.
        ``connect=False``: only over a connection already open (an unverified id may name any address)."""
        self.control.send(prefill_addr, Abort(request_id=request_id), connect=connect)

    def transfer_state(self, request_id: str) -> str:
        """A live transfer's :class:`~common.kv_transfer.receiver.TransferState` value;
        "finished" or "failed" until polled; else "unknown"."""
        with self._lock:
            link = self._owner_of.get(request_id)
            if request_id in self._finished or request_id in self._failed:
                return "finished" if request_id in self._finished else "failed"
        t = link.transfers.get(request_id) if link is not None else None
        return t.state.value if t is not None else "queued" if link is not None else "unknown"

    def poll_aborted(self) -> set[str]:
        """Aborted requests whose receive has stopped: nothing writes into their blocks any more."""
        with self._lock:
            out, self._aborted = self._aborted, set()
        return out

    def handle(self, address: str, msg: Message) -> None:
        """Control thread: an unsolicited message from a producer."""
        link = self._links.get(address)
        if link is None:
            logger.warning("consumer: %s from unknown producer %s dropped", msg.CMD, address)
            return
        link.events.put(("notice", msg))

    def pair_transports(self) -> list[str]:
        with self._lock:
            links = list(self._links.values())
        return [link.transport for link in links if link.transport]

    def close(self) -> None:
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        for link in links:
            link.events.put(None)
        for link in links:
            link.thread.join(timeout=self.config.handshake_timeout_s + self.config.timeout_s)

    # ---- link threads --------------------------------------------------------------------
    def _retire(self, link: PairReceiver) -> bool:
        """An idle link asks to end its thread; refused if work arrived for it meanwhile."""
        with self._lock:
            if self._links.get(link.address) is not link or not link.events.empty():
                return False
            del self._links[link.address]
            return True

    def _num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.block_size)

    def _done(self, t: Transfer, first_token: int, first_logprobs: list | None = None,
              choices: list | None = None, cached_tokens: int = 0) -> None:
        now = time.monotonic()
        self.stats.transfer_done(now - t.started, t.nbytes)
        if t.first_byte is not None:
            self.stats.transfer_rate(t.nbytes, now - t.first_byte)
        with self._lock:
            if self._owner_of.pop(t.request_id, None) is None:
                return
            self._finished[t.request_id] = first_token
            if first_logprobs:
                self._first_logprobs[t.request_id] = {int(tok): float(lp) for tok, lp in first_logprobs}
            if cached_tokens > 0:
                self._cached_tokens[t.request_id] = cached_tokens
            if choices:
                self._choices[t.request_id] = [(int(tok), {int(a): float(b) for a, b in lps} or None)
                                               for tok, lps in choices]
        self.on_progress()

    def _abort_stopped(self, request_id: str) -> None:
        with self._lock:
            self._aborted.add(request_id)
        self.on_progress()

    def _fail(self, t: Transfer, reason: str) -> None:
        self.stats.add(failures=1)
        with self._lock:
            if self._owner_of.pop(t.request_id, None) is None:
                return
            self._failed[t.request_id] = reason
        self.on_progress()
