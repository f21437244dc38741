"""The proxy's Prometheus metrics, in their own registry (one per app, so tests never clash)."""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ProxyMetrics:
    """Requests by status, latency, time to first token, per-node counts, nodes, errors."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pdserve:proxy_requests", "Requests answered, by HTTP status.", ["role", "status"], registry=r
        )
        self.latency = Histogram(
            "pdserve:proxy_request_latency_seconds",
            "Time from a request's arrival to its last byte sent.",
            ["role"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pdserve:time_to_first_token_seconds",
            "Streaming requests: arrival to the first decode bytes relayed, as the proxy sees it.",
            ["role"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.node_requests = Counter(
            "pdserve:proxy_node_requests", "Legs sent to each node.", ["role", "node"], registry=r
        )
        self.registered = Gauge(
            "pdserve:registered_nodes", "Nodes in the registry, by type (P or D).", ["role", "type"], registry=r
        )
        self.errors = Counter("pdserve:proxy_errors", "Errors, by kind.", ["role", "kind"], registry=r)
        self.retries = Counter("pdserve:proxy_prefill_retries", "Prefill legs retried.", ["role"], registry=r)

    def observe_request(self, status: int, latency_s: float) -> None:
        self.requests.labels("proxy", str(status)).inc()
        self.latency.labels("proxy").observe(latency_s)

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.labels("proxy").observe(seconds)

    def count_leg(self, node_role: str, node: str) -> None:
        self.node_requests.labels(node_role, node).inc()

    def count_error(self, kind: str) -> None:
        self.errors.labels("proxy", kind).inc()

    def count_retry(self) -> None:
        self.retries.labels("proxy").inc()

    def render(self, node_counts: Mapping[str, int]) -> bytes:
        """Prometheus text; the node gauge is refreshed here so it is never stale."""
        for node_type in ("P", "D"):
            self.registered.labels("proxy", node_type).set(node_counts.get(node_type, 0))
        return generate_latest(self.registry)
