"""Consumer side (decode node): ask a producer for a request's KV and land it in blocks.

A request's life here: ``request`` (engine thread) starts its one record
(:class:`~common.kv_transfer.consumer_table.Transfer`) and hands it to the producer's
:class:`~common.kv_transfer.receiver.PairReceiver` on the endpoint's I/O thread (the control
plane's: one thread for every producer), which makes sure a pair exists
(handshake: layout check, transport choice, pair build), sends PULL, then for each LAYER
notice receives the bytes into ``kv_caches[layer][:, block_ids]`` (tcp: straight into the
blocks; gloo/nccl: through a staging buffer unless the blocks are one run; cuda_ipc: the
producer already wrote them). DONE carries the first token; the link ACKs and the request
shows up in ``poll_finished``. A dead producer (failed receive, unanswered ping), an error
from the producer or ``abort`` end it.

The records and their states live in one :class:`~common.kv_transfer.consumer_table.ConsumerTable`
(``table``; its docstring has the transitions), which the decode connector's scheduler side
reads too. The links report through this class's public methods, on the I/O thread.
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
from common.kv_transfer.consumer_table import ConsumerState, ConsumerTable, Transfer
from common.kv_transfer.messages import Abort, Message
from common.kv_transfer.receiver import PairReceiver

if TYPE_CHECKING:
    from common.kv_transfer.control import ControlPlane

logger = logging.getLogger(__name__)


class KVConsumer:
    """The consumer half of :class:`~common.kv_transfer.endpoint.KVEndpoint`."""

    def __init__(self, layout: KVLayout, config: TransferConfig, stats: TransferStats,
                 transport: str = "auto", vocab_size: int | None = None) -> None:
        self.layout, self.config, self.stats = layout, config, stats
        self.vocab_size = vocab_size  # a DONE's tokens must lie in [0, vocab_size) (peer_checks.py)
        # whether KV may be pulled from this producer address; the decode daemon sets it from
        # --kv-peers and the registry's member list (common/node/daemon.py). Asked before anything opens.
        self.known_peer: Callable[[str], bool] = lambda address: True
        self.transport = transport  # --kv-transport: what this side asks for at each handshake
        self.address = ""  # this endpoint's own KV address, named in each handshake (set by the engine)
        self.control: ControlPlane  # set by the engine once bound
        self._lock = threading.Lock()
        self._links: dict[str, PairReceiver] = {}  # producer address -> its link (run on the I/O thread)
        self.table = ConsumerTable()  # the one record per transfer
        self._closed = False
        # called (from the I/O thread, without our lock) when a poll would return something new
        self.on_progress: Callable[[], None] = lambda: None

    # ---- engine thread -------------------------------------------------------------------
    def request(self, request_id: str, prefill_addr: str, block_ids: list[int], num_tokens: int,
                kv_caches: list[torch.Tensor], first_block: int = 0) -> None:
        """Ask the producer at ``prefill_addr`` ("host:port") for ``request_id``'s KV of a
        ``num_tokens``-token prompt from block ``first_block`` on (the blocks before it are
        already here) and land it in ``kv_caches[layer][:, block_ids]``. Returns at once; see
        :meth:`poll_finished`."""
        if len(kv_caches) != self.layout.num_layers:
            raise ValueError(f"{len(kv_caches)} KV layers, layout says {self.layout.num_layers}")
        if not 0 <= first_block < self.num_blocks(num_tokens):
            raise ValueError(f"first block {first_block} is outside a {num_tokens}-token prompt")
        if len(block_ids) < self.num_blocks(num_tokens) - first_block:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {num_tokens} tokens "
                             f"from block {first_block}")
        load = (request_id, block_ids, num_tokens, kv_caches, first_block)
        if not self.known_peer(prefill_addr):  # nothing is opened, nothing lands in the blocks
            self._refuse(load, f"{prefill_addr} is not a known prefill node (not in --kv-peers "
                               "nor registered with the proxy); not asking it for KV")
            return
        with self._lock:
            if self._closed:
                raise TransferError("KV endpoint closed")
            link = self._links.get(prefill_addr)
            full = link is None and len(self._links) >= self.config.max_peers
            if not full:
                if link is None:
                    link = self._links[prefill_addr] = PairReceiver(self, prefill_addr)
                t = self.table.start(*load, link)
                if t is not None:
                    self._post(link, link.new, t)  # under the lock: an idle link retires only with nothing posted
        if full:  # ids naming ever new addresses must not grow the links without bound
            self._refuse(load, f"{self.config.max_peers} producers already in use; not asking {prefill_addr}")

    def _refuse(self, load: tuple, reason: str) -> None:
        self.stats.add(failures=1)
        self.table.start(*load, None, error=reason)
        self.on_progress()

    def refuse(self, request_id: str, reason: str) -> None:
        """A load its caller could not even ask for (``request`` raised): FAILED with ``reason``,
        reported by the next :meth:`poll_finished` like any failed transfer."""
        self.table.start(request_id, [], 0, [], 0, None, error=reason)

    def poll_finished(self) -> tuple[dict[str, int], dict[str, str]]:
        """(request_id -> first token for landed transfers, request_id -> error for failed ones).
        A landed one's logprobs, choices and cached count wait for :meth:`take_landed` until the
        next poll."""
        return self.table.poll_finished()

    def take_landed(self, request_ids: set[str] | dict) -> dict[str, Transfer]:
        """The records of these just polled landed transfers (DONE's first-token logprobs, the
        other choices' first tokens, the producer's cached count), taken once."""
        return self.table.take_landed(request_ids)

    def abort(self, request_id: str) -> None:
        """Stop waiting for ``request_id`` and tell its producer to drop it. Its blocks may be
        reused once :meth:`poll_aborted` names it (a receive into them may still be running)."""
        link = self.table.stop(request_id)
        if link is not None:
            self.post(link, link.abort, request_id)

    def release_remote(self, request_id: str, prefill_addr: str, connect: bool | None = None) -> None:
        """Tell the producer at ``prefill_addr`` to drop ``request_id`` that this side will never
        ask for (e.g. the decode node refused the request): its KV is freed now, not at lease end.
        A connection is opened only where a pull would have opened one (``known_peer``; ``connect``
        overrides): to any other address (an unverified id may name any) only one already open is used."""
        if connect is None:
            connect = self.known_peer(prefill_addr)
        self.control.send(prefill_addr, Abort(request_id=request_id), connect=connect)

    def transfer_state(self, request_id: str) -> str:
        """The request's :class:`~common.kv_transfer.consumer_table.ConsumerState` value, or "unknown"
        (never asked for, or polled)."""
        return self.table.value(request_id)

    def poll_aborted(self) -> set[str]:
        """Aborted requests whose receive has stopped: nothing writes into their blocks any more."""
        return self.table.poll_aborted()

    # ---- I/O thread ----------------------------------------------------------------------
    def post(self, link: PairReceiver, step: Callable, *args) -> None:
        """Run ``link.step(*args)`` on the I/O thread (from any thread), after what was posted before."""
        with self._lock:
            self._post(link, step, *args)

    def _post(self, link: PairReceiver, step: Callable, *args) -> None:
        link.queued += 1  # under our lock
        self.control.call_soon(lambda: self._run(link, step, args))

    def _run(self, link: PairReceiver, step: Callable, args: tuple) -> None:
        with self._lock:
            link.queued -= 1
        link.run(step, *args)

    def handle(self, address: str, msg: Message) -> None:
        """An unsolicited message from a producer: its link handles it."""
        link = self._links.get(address)
        if link is None:
            logger.warning("consumer: %s from unknown producer %s dropped", msg.CMD, address)
            return
        link.run(link.notice, msg)

    def links(self) -> list[PairReceiver]:
        with self._lock:
            return list(self._links.values())

    def pair_transports(self) -> list[str]:
        return [link.transport for link in self.links() if link.transport]

    def close(self) -> None:
        """Close every link's pair, on the I/O thread (before the endpoint closes it)."""
        with self._lock:
            self._closed = True
            links = list(self._links.values())
        self.control.run_and_wait(lambda: [link.close() for link in links], self.config.timeout_s)

    # ---- the links: every state change of a record is one of these ------------------------------
    def retire(self, link: PairReceiver) -> bool:
        """An idle link asks to go; refused if work was posted for it meanwhile."""
        with self._lock:
            if self._links.get(link.address) is not link or link.queued:
                return False
            del self._links[link.address]
            return True

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.layout.block_size)

    def landed(self, t: Transfer, first_token: int, first_logprobs: list | None = None,
               choices: list | None = None, cached_tokens: int = 0) -> None:
        now = time.monotonic()
        self.stats.transfer_done(now - t.started, t.nbytes)
        if t.first_byte is not None:
            self.stats.transfer_rate(t.nbytes, now - t.first_byte)
        logprobs = {int(tok): float(lp) for tok, lp in first_logprobs} if first_logprobs else None
        firsts = [(int(tok), {int(a): float(b) for a, b in lps} or None) for tok, lps in choices or []]
        if self.table.finish(t, ConsumerState.LANDED, first_token=first_token, first_logprobs=logprobs,
                             choices=firsts, cached_tokens=max(cached_tokens, 0)):
            self.on_progress()

    def abort_stopped(self, request_id: str) -> None:
        """The link holds no receive into ``request_id``'s blocks any more."""
        self.table.abort_stopped(request_id)
        self.on_progress()

    def failed(self, t: Transfer, reason: str) -> None:
        self.stats.add(failures=1)
        if self.table.finish(t, ConsumerState.FAILED, error=reason):
            self.on_progress()
