"""Adaptive disaggregation (``--disagg-policy``): prefill on the prefill node, or on the decode node.

A remote prefill keeps long prompts off the decode node (steady inter-token latency) but costs
a prefill leg, a KV transfer and a hand-off; for a short prompt, or one the decode node mostly
has cached, that costs more than it saves. ``always`` sends every request to both nodes,
``never`` lets the decode node prefill every prompt itself, ``auto`` estimates both paths per
request from what the cluster measures:

    remote = (P's pending prompt tokens + uncached_P) / tokens_per_s_P + overhead_remote(P, D)
    local  = (D's pending prompt tokens + uncached_D) / tokens_per_s_D + overhead_local(D)

``tokens_per_s`` and pending tokens come from each node's heartbeat (an EWMA of its timed
prefill steps); a decode node that has not prefilled yet borrows the prefill node's rate (same
model, same KV layout). The overheads are what each path's time to first token measured here
beyond its predicted compute (EWMA per pair / per decode node): for the remote path the prefill
leg, the hand-off and the part of the transfer the per-layer push does not hide. The uncached
parts come from the text of the prompts this proxy sent each node (64-character chunks, the
tokens estimated at ``CHARS_PER_TOKEN``); the decode node knows its cache exactly and the engine
bounds the stall, so an estimate that is off costs time, never a wrong answer.

Local is chosen when it is cheaper and its whole uncached prefill fits the decode node's
``--max-local-prefill-stall-ms`` (reported in its heartbeat) at its rate: one bounded step, so
decodes running there, or arriving meanwhile, see at most one bounded hiccup. (A longer local
prefill would be cheaper for its own first token on an idle decode node, and then hold every
request that arrives during it to bounded-but-slow steps; the decode node is the 1P1D
bottleneck, so it is kept for short work.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from common.registry_client import RegistrationMessage
from proxy.prefix_policy import PrefixAware, chunk_hashes

logger = logging.getLogger(__name__)

CHARS_PER_TOKEN = 3.6  # the embedded byte-level BPE on English text measured 3.6; real tokenizers ~4
DEFAULT_REMOTE_OVERHEAD_S = 0.02  # until this proxy has timed a remote request of the pair
EWMA_WEIGHT = 0.2
Path = Literal["local", "remote"]


@dataclass(frozen=True)
class Decision:
    """Where one request is prefilled and why; the estimates (seconds) when ``auto`` made them."""

    path: Path
    reason: str  # policy | no_figures | cheaper_local | cheaper_remote | stall_bound
    est_local_s: float | None = None
    est_remote_s: float | None = None
    compute_s: float | None = None  # the chosen path's predicted compute (its overhead is measured against it)

    @property
    def local(self) -> bool:
        return self.path == "local"


class DisaggPolicy:
    """Decides per request; learns each path's overhead from the TTFTs it is told about."""

    def __init__(self, mode: Literal["always", "never", "auto"]) -> None:
        self.mode = mode
        self._prefixes = PrefixAware()  # its memory only: which prompt chunks went to which node
        self._remote_overhead: dict[tuple[str, str], float] = {}  # (P, D) http addresses -> seconds
        self._local_overhead: dict[str, float] = {}  # D -> seconds

    def decide(self, prefill: RegistrationMessage, decode: RegistrationMessage, prompt: str) -> Decision:
        """``prompt``: the request's text (as prefix_aware reads it)."""
        if self.mode != "auto":
            return Decision("remote" if self.mode == "always" else "local", "policy")
        chunks = chunk_hashes(prompt, self._prefixes.chunk_chars)
        tokens = len(prompt) / CHARS_PER_TOKEN
        cached_p = self._cached_tokens(("P", prefill.http_address), chunks)
        cached_d = self._cached_tokens(("D", decode.http_address), chunks)
        rate_p = prefill.prefill_tokens_per_s or decode.prefill_tokens_per_s
        rate_d = decode.prefill_tokens_per_s or rate_p
        if rate_p is None or rate_d is None:
            return Decision("remote", "no_figures")
        compute_remote = ((prefill.pending_prefill_tokens or 0) + max(tokens - cached_p, 1)) / rate_p
        compute_local = ((decode.pending_prefill_tokens or 0) + max(tokens - cached_d, 1)) / rate_d
        est_remote = compute_remote + self._remote_overhead.get(
            (prefill.http_address, decode.http_address), DEFAULT_REMOTE_OVERHEAD_S)
        est_local = compute_local + self._local_overhead.get(decode.http_address, 0.0)
        if est_remote <= est_local:
            return Decision("remote", "cheaper_remote", est_local, est_remote, compute_remote)
        bound_ms = decode.max_local_prefill_stall_ms
        if bound_ms is not None and max(tokens - cached_d, 1) / rate_d * 1000 > bound_ms:
            return Decision("remote", "stall_bound", est_local, est_remote, compute_remote)
        return Decision("local", "cheaper_local", est_local, est_remote, compute_local)

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
        if decision.compute_s is None:
            return
        overhead = max(ttft_s - decision.compute_s, 0.0)
        if decision.local:
            table, key = self._local_overhead, decode.http_address
        else:
            table, key = self._remote_overhead, (prefill.http_address, decode.http_address)
        old = table.get(key)
        table[key] = overhead if old is None else old + EWMA_WEIGHT * (overhead - old)
        if len(table) > 4096:  # node addresses come and go: keep it bounded
            table.pop(next(iter(table)))

    def _cached_tokens(self, key: tuple[str, str], chunks: list[bytes]) -> float:
        return self._prefixes.matched(key, chunks) * self._prefixes.chunk_chars / CHARS_PER_TOKEN
