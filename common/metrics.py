"""Prometheus metrics of one node, in vLLM's meanings under the ``pdserve:`` prefix.

Each :class:`NodeMetrics` owns its registry, so several nodes (or tests) in one process
never share counters. Queue gauges are read from the engine when ``/metrics`` is scraped.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST

from common.engine.protocol import EngineStats

PREFIX = "pdserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets in seconds: sub-millisecond CPU steps up to minute-long requests.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TIER_COUNTERS = {  # KVTiers.stats() keys exported as counters (pdserve:kv_tier_<key>_total{role, tier})
    "hits": "KV blocks loaded back from a KV tier",
    "misses": "KV blocks a prefix lookup asked a KV tier for and it did not have (or could not load)",
    "load_seconds": "Seconds spent loading KV blocks from a KV tier",
    "store_seconds": "Seconds spent storing KV blocks in a KV tier",
    "errors": "KV tier faults (unusable directory, full disk, damaged file, I/O error): each one recomputed",
    "dropped": "KV blocks not stored because the tier's write queue was full",
    "served": "KV blocks a KV tier gave peers' fetches (the peer tier's serving side; the pool's are in "
              "pdserve:kv_peer_served_blocks with them)",
}
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class NodeMetrics:
    """The request, queue and KV-transfer metrics one node exports."""

    def __init__(self, role: str, tensor_parallel_size: int = 1) -> None:
        self.role = role
        self.registry = CollectorRegistry(auto_describe=True)
        self._stats_source: Callable[[], EngineStats] | None = None
        self._scrape_hooks: list[Callable[[], None]] = []
        labels = ["role"]

        # Role-only series are created up front so a fresh node exports zeros, not nothing.
        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            metric = Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=self.registry)
            metric.labels(role)
            return metric

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            metric = Counter(PREFIX + name, doc, labels + list(extra), registry=self.registry)
            if not extra:
                metric.labels(role)
            return metric

        def gauge(name: str, doc: str) -> Gauge:
            metric = Gauge(PREFIX + name, doc, labels, registry=self.registry)
            metric.labels(role)
            return metric

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from request arrival to its first token", _LATENCY_BUCKETS
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens", _LATENCY_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from request arrival to its last token", _E2E_BUCKETS
        )
        self.num_requests_running = gauge("num_requests_running", "Requests in the running batch")
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Requests waiting to be scheduled (including those awaiting remote KV)"
        )
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)")
        gauge("tensor_parallel_size", "Ranks (processes) this node's model runs on: --tensor-parallel-size").labels(
            role).set(tensor_parallel_size)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens")
        self.request_success = counter("request_success", "Requests that finished", ("finish_reason",))
        self.request_errors = counter("request_errors", "Requests that failed", ("kind",))
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the cache")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens whose KV the prefix cache had")
        self._cache_counts = {"queries": 0, "hits": 0}  # engine totals already exported
        # KV tiers (common/engine/kv_tiers.py), per tier ("host", "disk", "peer"): present only on a node with tiers
        self.kv_tier_bytes = Gauge(PREFIX + "kv_tier_bytes", "Bytes of KV blocks a KV tier holds", ["role", "tier"],
                                   registry=self.registry)
        self.kv_tier_blocks = Gauge(PREFIX + "kv_tier_blocks", "KV blocks a KV tier holds", ["role", "tier"],
                                    registry=self.registry)
        self.kv_tier_totals = {name: Counter(PREFIX + "kv_tier_" + name, doc, ["role", "tier"], registry=self.registry)
                               for name, doc in TIER_COUNTERS.items()}
        self._tier_counts: dict[tuple[str, str], float] = {}
        self.kv_transfer_seconds = histogram(
            "kv_transfer_seconds", "Duration of one request's KV transfer", _LATENCY_BUCKETS
        )
        self.kv_transfer_bytes = counter("kv_transfer_bytes", "KV cache bytes moved between nodes")
        self.kv_rank_transfer_bytes = counter(
            "kv_rank_transfer_bytes", "KV cache bytes this tensor-parallel rank sent (prefill) or received (decode)",
            ("rank",))
        self.kv_rank_transfer_seconds = counter(
            "kv_rank_transfer_seconds", "Seconds this tensor-parallel rank's finished transfers took, summed",
            ("rank",))
        self.kv_transfer_failures = counter("kv_transfer_failures", "KV transfers that failed or timed out")
        self.kv_transfer_rejected = counter(
            "kv_transfer_rejected", "Landed KV refused before use: partial, stale, damaged or not asked for",
            ("reason",))
        self.kv_leases_expired = counter(
            "kv_leases_expired", "Prefill KV held for a peer that never asked, freed at lease end"
        )

    def bind_engine_stats(self, source: Callable[[], EngineStats]) -> None:
        """Read queue and KV gauges from ``source`` at every scrape."""
        self._stats_source = source

    def add_scrape_hook(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` at every scrape (e.g. turn another component's counters into metrics)."""
        self._scrape_hooks.append(hook)

    def refresh(self) -> None:
        for hook in self._scrape_hooks:
            hook()
        if self._stats_source is None:
            return
        stats = self._stats_source()
        self.num_requests_running.labels(self.role).set(stats.num_running)
        self.num_requests_waiting.labels(self.role).set(stats.num_waiting)
        self.kv_cache_usage_perc.labels(self.role).set(stats.kv_cache_usage)
        for name, counter, total in (("queries", self.prefix_cache_queries, stats.prefix_cache_queries),
                                     ("hits", self.prefix_cache_hits, stats.prefix_cache_hits)):
            if total > self._cache_counts[name]:  # the engine keeps totals: export the increase
                counter.labels(self.role).inc(total - self._cache_counts[name])
                self._cache_counts[name] = total

        if stats.kv_tiers:
            self._export_tiers(stats.kv_tiers)

    def _export_tiers(self, tiers: dict[str, dict[str, float]]) -> None:
        for tier, figures in tiers.items():
            self.kv_tier_bytes.labels(self.role, tier).set(figures["bytes"])
            self.kv_tier_blocks.labels(self.role, tier).set(figures["blocks"])
            for name, counter in self.kv_tier_totals.items():
                total, seen = figures.get(name, 0), self._tier_counts.get((tier, name), 0)
                counter.labels(self.role, tier).inc(max(total - seen, 0))
                self._tier_counts[(tier, name)] = max(total, seen)

    def render(self) -> bytes:
        """The Prometheus text exposition (gauges refreshed first)."""
        self.refresh()
        return generate_latest(self.registry)

    # Small helpers so call sites read as what happened, not as label plumbing.

    def observe_first_token(self, seconds: float) -> None:
        self.time_to_first_token.labels(self.role).observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token_latency.labels(self.role).observe(seconds)

    def observe_generated(self, num_tokens: int) -> None:
        self.generation_tokens.labels(self.role).inc(num_tokens)

    def observe_finished(self, finish_reason: str, num_prompt_tokens: int, e2e_seconds: float) -> None:
        self.request_success.labels(self.role, finish_reason).inc()
        self.prompt_tokens.labels(self.role).inc(num_prompt_tokens)
        self.e2e_request_latency.labels(self.role).observe(e2e_seconds)

    def observe_error(self, kind: str) -> None:
        self.request_errors.labels(self.role, kind).inc()

    def observe_transfer(self, seconds: float, num_bytes: int) -> None:
        self.kv_transfer_seconds.labels(self.role).observe(seconds)
        self.kv_transfer_bytes.labels(self.role).inc(num_bytes)
