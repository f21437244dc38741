"""Adaptive disaggregation (``--disagg-policy``): prefill on the prefill node, or on the decode node.

A remote prefill keeps long prompts off the decode node (steady inter-token latency) but costs
a prefill leg, a KV transfer and a hand-off; for a short prompt, or one the decode node mostly
has cached, that costs more than it saves. ``always`` sends every request to both nodes,
``never`` lets the decode node prefill every prompt itself, ``auto`` estimates both paths per
request from what the cluster measures (every figure but the hand-off from the heartbeats):

    remote = queue_P + compute_P + transfer + handoff(P, D)
        queue_P   = P's pending prompt tokens / tokens_per_s_P
        compute_P = uncached_P / tokens_per_s_P
        transfer  = max(uncached_D x kv_bytes_per_token / transfer rate - compute_P, 0)
    local  = queue_D + compute_D + overhead_local(D),   compute_D = uncached_D / tokens_per_s_D
    stall  = num_decoding x compute_D   (what the decodes running on D wait for it, in all)

``tokens_per_s``, pending tokens and ``num_decoding`` come from each node's heartbeat (an EWMA
of its timed prefill steps); a decode node that has not prefilled yet borrows the prefill node's
rate (same model, same KV layout). ``kv_bytes_per_token`` is the KV layout's, the transfer rate
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
its heartbeat) -> remote (``stall_bound``): decodes there, or arriving meanwhile, see at most one
bounded hiccup (a longer local prefill would be cheaper for its own first token on an idle decode
node, and then hold every request arriving during it to bounded-but-slow steps; the decode node
is the 1P1D bottleneck, so it is kept for short work); ``local + stall`` above ``remote`` ->
remote (``busy_decode``): the time the running batch would lose outweighs what the request gains;
else local (``cheaper_local``).
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

    @property
    def local(self) -> bool:
        return self.path == "local"


class PathCost:
    """One path's fixed cost per key (a node pair, or a decode node): the median of its last
    ``COST_SAMPLES`` measured costs younger than ``COST_TTL_S``, else ``prior``."""

    def __init__(self, prior: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.prior, self.clock = prior, clock
        self._samples: dict[object, deque[tuple[float, float]]] = {}  # key -> (when, seconds)

    def observe(self, key: object, seconds: float) -> None:
        samples = self._samples.pop(key, None) or deque(maxlen=COST_SAMPLES)
        samples.append((self.clock(), seconds))
        self._samples[key] = samples  # last used goes last: the first is the one to drop
        if len(self._samples) > MAX_COST_KEYS:
            self._samples.pop(next(iter(self._samples)))

    def get(self, key: object) -> float:
        samples = self._samples.get(key)
        now = self.clock()
        while samples and now - samples[0][0] > COST_TTL_S:
            samples.popleft()
        return statistics.median(seconds for _, seconds in samples) if samples else self.prior


class DisaggPolicy:
    """Decides per request; learns each path's fixed cost from the TTFTs it is told about."""

    def __init__(self, mode: Literal["always", "never", "auto"], clock: Callable[[], float] = time.monotonic) -> None:
        self.mode = mode
        self._prefixes = PrefixAware()  # its memory only: which prompt chunks went to which node
        self._remote_cost = PathCost(DEFAULT_REMOTE_OVERHEAD_S, clock)  # keyed by (P, D) http addresses
        self._local_cost = PathCost(0.0, clock)  # keyed by D's http address
        self.exact: ExactPrefix | None = None  # exact cached counts, when the nodes' KV events are indexed

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
        bytes_per_token = decode.kv_bytes_per_token or prefill.kv_bytes_per_token
        transfer = 0.0  # not measured yet: the hand-off's measured cost holds it
        if bytes_per_token and decode.kv_transfer_bytes_per_s:
            transfer = max(uncached_d * bytes_per_token / decode.kv_transfer_bytes_per_s - compute_p, 0.0)
        before_handoff = (prefill.pending_prefill_tokens or 0) / rate_p + compute_p + transfer
        est_remote = before_handoff + self._remote_cost.get((prefill.http_address, decode.http_address))
        compute_d = uncached_d / rate_d
        compute_local = (decode.pending_prefill_tokens or 0) / rate_d + compute_d
        est_local = compute_local + self._local_cost.get(decode.http_address)
        stall = (decode.num_decoding or 0) * compute_d
        figures = dict(est_local_s=est_local, est_remote_s=est_remote, stall_s=stall)
        if est_remote < est_local:
            return Decision("remote", "cheaper_remote", compute_s=before_handoff, **figures)
        bound_ms = decode.max_local_prefill_stall_ms
        if bound_ms is not None and compute_d * 1000 > bound_ms:
            return Decision("remote", "stall_bound", compute_s=before_handoff, **figures)
        if est_local + stall > est_remote:
            return Decision("remote", "busy_decode", compute_s=before_handoff, **figures)
        return Decision("local", "cheaper_local", compute_s=compute_local, **figures)

    def sent(self, decision: Decision, prefill: RegistrationMessage, decode: RegistrationMessage,
             prompt: str) -> None:
        """Note where the prompt's KV now lives (D always; P on a remote prefill)."""
        if self.mode != "auto":
            return
        chunks = chunk_hashes(prompt, self._prefixes.chunk_chars)
        self._prefixes.remember(("D", decode.http_address), chunks)
        if not decision.local:
            self._prefixes.remember(("P", prefill.http_address), chunks)

    def observe_ttft(self, decision: Decision, prefill: RegistrationMessage, decode: RegistrationMessage,
                     ttft_s: float) -> None:
        """A streamed request's time to first token: what its path took beyond its predicted compute."""
        if decision.compute_s is None or decision.compute_s > ttft_s / 2:
            # a first token mostly spent computing measures the rate's error more than the
            # hand-off: a long prompt's prefill runs faster per token than the rate from short
            # steps says, its residual comes out <= 0, and learning it would price every
            # hand-off at nothing (then a short prompt's two estimates tie)
            return
        cost = ttft_s - decision.compute_s
        if decision.local:
            self._local_cost.observe(decode.http_address, cost)
        else:
            self._remote_cost.observe((prefill.http_address, decode.http_address), cost)

    def _cached_tokens(self, key: tuple[str, str], chunks: list[bytes]) -> float:
        return self._prefixes.matched(key, chunks) * self._prefixes.chunk_chars / CHARS_PER_TOKEN
