"""Adaptive disaggregation (``--disagg-policy``): prefill on the prefill node, or on the decode node.

A remote prefill keeps long prompts off the decode node (steady inter-token latency) but costs
a prefill leg, a KV transfer and a hand-off; for a short prompt, or one the decode node mostly
has cached, that costs more than it saves. ``always`` sends every request to both nodes,
``never`` lets the decode node prefill every prompt itself, ``auto`` estimates both paths per
request from what the cluster measures (every figure but the hand-off from the heartbeats):

    remote = queue_P + compute_P + transfer + handoff(P, D)
        queue_P   = P's pending prompt tokens / tokens_per_s_P (+ what this proxy sent it since)
        compute_P = uncached_P / tokens_per_s_P
        transfer  = max(uncached_D x kv_bytes_per_token / transfer rate - compute_P, 0)
    local  = queue_D + compute_D + overhead_local(D),   compute_D = uncached_D / tokens_per_s_D
    stall  = decoding x compute_D   (what the decodes running on D wait for it, in all)

``tokens_per_s``, pending tokens and ``num_decoding`` come from each node's heartbeat (an EWMA
of its timed prefill steps); a heartbeat is up to an interval old and a burst is decided within
one, so each node's queue also holds the prompts this proxy sent it since (``Unreported``), and
``decoding`` is this proxy's own count of requests in flight on D when the router lends it
(``in_flight``), else the heartbeat's ``num_decoding`` and at least the requests sent since. A
decode node that has not prefilled yet borrows the prefill node's rate (same model, same KV
layout). ``kv_bytes_per_token`` is the KV layout's, the transfer rate
the decode node's EWMA of its received transfers, timed from first byte to DONE (not from the
PULL, which would count P's queue and prefill as transfer). D asks only for the blocks it lacks,
so ``uncached_D`` tokens move; layers travel while P computes the next, so only what outlasts
``compute_P`` adds. The hand-off (the prefill leg, the PULL, DONE, the first decode step) is the
fixed cost the proxy measures itself: each streamed request's time to first token beyond the
other terms (per pair; the local path's likewise per decode node; only first tokens not mostly
spent computing), as the median of the last ``COST_SAMPLES`` measured within ``COST_TTL_S``
(``PathCost``). A path only gets measured when it is taken, so one slow first token (a cold
start, a pause) priced into a running average would keep ``auto`` off that path for good; a
median ignores it once other samples come, and an expired estimate falls back to its prior,
so the path is taken and measured again. The uncached parts come from the nodes' KV events when
the proxy indexes them and knows the prompt's token ids (``proxy/exact_prefix.py``: exact counts,
a node whose events cannot say counting as caching nothing); else from the text of the prompts
this proxy sent each node (64-character chunks, the tokens estimated at ``CHARS_PER_TOKEN``); the decode node knows its cache exactly and overrides a remote
tag for a prompt it has cached (decode_node.connector), and the engine bounds the stall, so an
estimate that is off costs time, never a wrong answer.

The decision, each with its reason label: no prefill rate measured anywhere -> remote
(``no_figures``); remote faster for this request's first token -> remote (``cheaper_remote``; a tie
goes on to the local checks: no transfer, and the prefill node stays free for long prompts);
its uncached prefill does not fit one step of D's ``--max-local-prefill-stall-ms`` (reported in
its heartbeat) and would hold up others -> remote (``stall_bound``): decodes there, or arriving
meanwhile, see at most one bounded hiccup (the decode node is the 1P1D bottleneck, so it is kept
for short work). Others are held up when decodes run or prompts wait there, or when the requests
expected during it (this proxy's rate to D over the last ``ARRIVALS_WINDOW_S``, at least one per
window) would wait for it (all of it each) longer, in all, than local saves this one: at one client
on an idle decode node, a prompt a little over the bound used to go remote and pay the hand-off
for nothing (bench/adaptive.py's closed loop: 256-token prompts, one client). Then ``local +
stall`` above ``remote`` -> remote (``busy_decode``): the time the running batch would lose
outweighs what the request gains; else local (``cheaper_local``).
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from common.registry_client import RegistrationMessage
from proxy.exact_prefix import ExactPrefix
from proxy.prefix_policy import PrefixAware, chunk_hashes

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 3.6  # the embedded byte-level BPE on English text measured 3.6; real tokenizers ~4
DEFAULT_REMOTE_OVERHEAD_S = 0.02  # until this proxy has timed a remote request of the pair
COST_SAMPLES = 8  # a path's fixed cost is the median of its last 8 measured ...
COST_TTL_S = 10.0  # ... not older than this
UNREPORTED_TTL_S = 5.0  # what this proxy sent a node counts until its next heartbeat, at most this long
ARRIVALS_WINDOW_S = 10.0  # a decode node's request rate: what this proxy sent it in the last 10 s
MAX_COST_KEYS = 4096  # node addresses come and go: keep the tables bounded
Path = Literal["local", "remote"]


@dataclass(frozen=True)
class Decision:
    """Where one request is prefilled and why; the estimates (seconds) when ``auto`` made them."""

    path: Path
    reason: str  # policy | no_figures | cheaper_local | cheaper_remote | stall_bound | busy_decode
    est_local_s: float | None = None  # this request's first token, local (the stall on others apart)
    est_remote_s: float | None = None
    compute_s: float | None = None  # the chosen path's predicted time bar its fixed cost (measured against it)
    stall_s: float | None = None  # what the decodes running on D would wait for a local prefill, in all
    prefill_s: float | None = None  # the prompt's predicted compute on the node that prefills it

    @property
    def local(self) -> bool:
        return self.path == "local"


class _Recent:
    """Per key, the (when, value) entries of the last ``window_s`` (at most ``maxlen`` a key); past
    ``MAX_COST_KEYS`` keys the least recently added to goes."""

    def __init__(self, clock: Callable[[], float], window_s: float, maxlen: int | None = None) -> None:
        self.clock, self.window_s, self.maxlen = clock, window_s, maxlen
        self._entries: dict[object, deque[tuple[float, float]]] = {}

    def add(self, key: object, value: float = 0.0) -> None:
        entries = self._entries.pop(key, None) or deque(maxlen=self.maxlen)
        entries.append((self.clock(), value))
        self._entries[key] = entries  # last used goes last: the first is the one to drop
        if len(self._entries) > MAX_COST_KEYS:
            self._entries.pop(next(iter(self._entries)))

    def live(self, key: object) -> deque[tuple[float, float]]:
        entries = self._entries.get(key, deque())
        now = self.clock()
        while entries and now - entries[0][0] > self.window_s:
            entries.popleft()
        return entries


class PathCost:
    """One path's fixed cost per key (a node pair, or a decode node): the median of its last
    ``COST_SAMPLES`` measured costs younger than ``COST_TTL_S``, else ``prior``."""

    def __init__(self, prior: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.prior = prior
        self._samples = _Recent(clock, COST_TTL_S, COST_SAMPLES)

    def observe(self, key: object, seconds: float) -> None:
        self._samples.add(key, seconds)

    def get(self, key: object) -> float:
        samples = self._samples.live(key)
        return statistics.median(seconds for _, seconds in samples) if samples else self.prior


@dataclass
class _SinceHeartbeat:
    heartbeat: RegistrationMessage  # the last one this proxy decided with (a new heartbeat is a new object)
    seen: float  # when this proxy first decided with it
    busy_until: float  # when the node's prefill queue drains: the heartbeat's, then what was sent since
    requests: int = 0  # requests sent since


class Unreported:
    """Per node, what this proxy sent it since the heartbeat it last decided with.

    A heartbeat is up to an interval old, and a burst is decided within one: 16 clients starting
    together on an idle cluster would all see an idle decode node, all go local, and queue behind
    each other there. A node's prefill queue is kept as the time it drains (the heartbeat's
    pending tokens at its rate from when this proxy first saw it, then each prompt sent since at
    its predicted compute); a decode node runs at least the requests sent it since (every request
    decodes there). A new heartbeat starts again from its own figures."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._nodes: dict[tuple[str, str], _SinceHeartbeat] = {}

    def refresh(self, key: tuple[str, str], node: RegistrationMessage, pending_s: float) -> _SinceHeartbeat:
        """The node's record, started again from ``node`` (its latest heartbeat; ``pending_s``: its
        queue's compute) when that is newer than the one held."""
        now = self.clock()
        since = self._nodes.get(key)
        if since is None or since.heartbeat is not node or now - since.seen > UNREPORTED_TTL_S:
            since = self._nodes[key] = _SinceHeartbeat(node, now, now + pending_s)
            if len(self._nodes) > MAX_COST_KEYS:
                self._nodes.pop(next(iter(self._nodes)))
        return since

    def queue_s(self, since: _SinceHeartbeat) -> float:
        return max(since.busy_until - self.clock(), 0.0)

    def add(self, key: tuple[str, str], node: RegistrationMessage, prefill_s: float = 0.0) -> None:
        """A request sent to ``node``, ``prefill_s`` of prompt computed there."""
        since = self._nodes.get(key)
        if since is not None and since.heartbeat is node:
            since.busy_until = max(since.busy_until, self.clock()) + prefill_s
            since.requests += 1


class Arrivals:
    """Per decode node, the requests per second this proxy sent it over the last ``ARRIVALS_WINDOW_S``."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._times = _Recent(clock, ARRIVALS_WINDOW_S)

    def add(self, key: str) -> None:
        self._times.add(key)

    def per_s(self, key: str) -> float:
        """At least one per window: a quiet spell says little of the next seconds."""
        return max(len(self._times.live(key)), 1) / ARRIVALS_WINDOW_S


def transfer_s(tokens: float, compute_p: float, prefill: RegistrationMessage, decode: RegistrationMessage) -> float:
    """What moving ``tokens`` of KV from P to D adds after P's ``compute_p`` (layers travel while P
    computes the next); 0 until D has measured a transfer (the hand-off's measured cost holds it)."""
    bytes_per_token = decode.kv_bytes_per_token or prefill.kv_bytes_per_token
    if not (bytes_per_token and decode.kv_transfer_bytes_per_s):
        return 0.0
    return max(tokens * bytes_per_token / decode.kv_transfer_bytes_per_s - compute_p, 0.0)


class DisaggPolicy:
    """Decides per request; learns each path's fixed cost from the TTFTs it is told about."""

    def __init__(self, mode: Literal["always", "never", "auto"], clock: Callable[[], float] = time.monotonic) -> None:
        self.mode = mode
        self._prefixes = PrefixAware()  # its memory only: which prompt chunks went to which node
        self._remote_cost = PathCost(DEFAULT_REMOTE_OVERHEAD_S, clock)  # keyed by (P, D) http addresses
        self._local_cost = PathCost(0.0, clock)  # keyed by D's http address
        self.exact: ExactPrefix | None = None  # exact cached counts, when the nodes' KV events are indexed
        self._unreported = Unreported(clock)
        self._arrivals = Arrivals(clock)
        # this proxy's requests in flight on a decode node (the router's count, by its http address):
        # fresher than a heartbeat's num_decoding, which at one client still counts the request that
        # just ended; None: the heartbeat's, and at least what was sent since
        self.in_flight: Callable[[str], int] | None = None

    def decide(self, prefill: RegistrationMessage, decode: RegistrationMessage, prompt: str) -> Decision:
        """``prompt``: the request's text (as prefix_aware reads it)."""
        if self.mode != "auto":
            return Decision("remote" if self.mode == "always" else "local", "policy")
        exact = self.exact.cached_tokens([prefill, decode], prompt) if self.exact is not None else None
        if exact is not None:  # the nodes' KV events (a node they cannot speak for caches nothing)
            tokens = float(len(prompt.token_ids))  # type: ignore[attr-defined]
            cached_p, cached_d = exact[("P", prefill.http_address)], exact[("D", decode.http_address)]
        else:
            chunks = chunk_hashes(prompt, self._prefixes.chunk_chars)
            tokens = len(prompt) / CHARS_PER_TOKEN
            cached_p = self._cached_tokens(("P", prefill.http_address), chunks)
            cached_d = self._cached_tokens(("D", decode.http_address), chunks)
        rate_p = prefill.prefill_tokens_per_s or decode.prefill_tokens_per_s
        rate_d = decode.prefill_tokens_per_s or rate_p
        if rate_p is None or rate_d is None:
            return Decision("remote", "no_figures")
        uncached_d = max(tokens - cached_d, 1)
        compute_p = max(tokens - cached_p, 1) / rate_p
        since_p = self._unreported.refresh(("P", prefill.http_address), prefill,
                                           (prefill.pending_prefill_tokens or 0) / rate_p)
        since_d = self._unreported.refresh(("D", decode.http_address), decode,
                                           (decode.pending_prefill_tokens or 0) / rate_d)
        transfer = transfer_s(uncached_d, compute_p, prefill, decode)
        before_handoff = self._unreported.queue_s(since_p) + compute_p + transfer
        est_remote = before_handoff + self._remote_cost.get((prefill.http_address, decode.http_address))
        compute_d = uncached_d / rate_d
        compute_local = self._unreported.queue_s(since_d) + compute_d
        est_local = compute_local + self._local_cost.get(decode.http_address)
        decoding = self._decoding(decode, since_d)
        stall = decoding * compute_d
        figures = dict(est_local_s=est_local, est_remote_s=est_remote, stall_s=stall)
        if est_remote < est_local:
            return Decision("remote", "cheaper_remote", compute_s=before_handoff, prefill_s=compute_p, **figures)
        bound_ms = decode.max_local_prefill_stall_ms
        if (bound_ms is not None and compute_d * 1000 > bound_ms
                and self._holds_up_others(decode, decoding, compute_local - compute_d, compute_d, est_remote - est_local)):
            return Decision("remote", "stall_bound", compute_s=before_handoff, prefill_s=compute_p, **figures)
        if est_local + stall > est_remote:
            return Decision("remote", "busy_decode", compute_s=before_handoff, prefill_s=compute_p, **figures)
        return Decision("local", "cheaper_local", compute_s=compute_local, prefill_s=compute_d, **figures)

    def handoff_s(self, prefill: RegistrationMessage, decode: RegistrationMessage) -> float:
        """The pair's measured hand-off (prefill leg, PULL, DONE, first decode step), else its prior."""
        return self._remote_cost.get((prefill.http_address, decode.http_address))

    def _decoding(self, decode: RegistrationMessage, since: _SinceHeartbeat) -> int:
        """The requests decoding on ``decode`` now, or about to (their prefill under way)."""
        if self.in_flight is not None:
            return self.in_flight(decode.http_address)
        return max(decode.num_decoding or 0, since.requests)

    def _holds_up_others(self, decode: RegistrationMessage, decoding: int, queued_s: float, compute_s: float,
                         saved_s: float) -> bool:
        """Whether a local prefill longer than one bounded step would hold up other requests: decodes
        running there or prompts queued, or the requests expected while it runs (this proxy's recent
        rate to the node) waiting for it longer, in all, than this one saves. An arrival is counted
        as waiting all of it: its first token waits for the rest of the prefill, and its decodes
        then share steps with it (counted as waiting half of it, 2,500-token prompts went local beside
        arrivals at 2 requests/s, and TTFT p99 doubled in that loaded run)."""
        expected = self._arrivals.per_s(decode.http_address) * compute_s
        return decoding > 0 or queued_s > 0 or expected * compute_s > saved_s

    def sent(self, decision: Decision, prefill: RegistrationMessage, decode: RegistrationMessage,
             prompt: str) -> None:
        """Note where the prompt's KV now lives (D always; P on a remote prefill), and what each
        node now has queued that its heartbeat cannot say yet."""
        if self.mode != "auto":
            return
        if decision.prefill_s is not None:
            self._arrivals.add(decode.http_address)
            self._unreported.add(("D", decode.http_address), decode, decision.prefill_s if decision.local else 0.0)
            if not decision.local:
                self._unreported.add(("P", prefill.http_address), prefill, decision.prefill_s)
        chunks = chunk_hashes(prompt, self._prefixes.chunk_chars)
        self._prefixes.remember(("D", decode.http_address), chunks)
        if not decision.local:
            self._prefixes.remember(("P", prefill.http_address), chunks)

    def observe_ttft(self, decision: Decision, prefill: RegistrationMessage, decode: RegistrationMessage,
                     ttft_s: float) -> None:
        """A streamed request's time to first token: what its path took beyond its predicted compute."""
        if decision.compute_s is None:
            return
        cost = ttft_s - decision.compute_s
        if decision.local:
            # every local first token counts (at no less than 0): the local path adds little to its
            # compute, so the test below would pass only its slow first tokens, and one of those
            # alone priced local ~200 ms dearer for COST_TTL_S (seen at one client)
            self._local_cost.observe(decode.http_address, max(cost, 0.0))
        elif decision.compute_s <= ttft_s / 2:
            # a first token mostly spent computing measures the rate's error more than the
            # hand-off: a long prompt's prefill runs faster per token than the rate from short
            # steps says, its residual comes out <= 0, and learning it would price every
            # hand-off at nothing (then a short prompt's two estimates tie)
            self._remote_cost.observe((prefill.http_address, decode.http_address), cost)

    def _cached_tokens(self, key: tuple[str, str], chunks: list[bytes]) -> float:
        return self._prefixes.matched(key, chunks) * self._prefixes.chunk_chars / CHARS_PER_TOKEN
