"""The proxy's Prometheus metrics, in their own registry (one per app, so tests never clash)."""

from __future__ import annotations

import json
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
            "Streaming requests: arrival to the first content token relayed (as a client times it).",
            ["role"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.node_requests = Counter(
            "pdserve:proxy_node_requests", "Legs sent to each node.", ["role", "node"], registry=r
        )
        self.registered = Gauge(
            "pdserve:registered_nodes", "Nodes in the registry, by type (P or D).", ["role", "type"],
            registry=r,
        )
        self.errors = Counter("pdserve:proxy_errors", "Errors, by kind.", ["role", "kind"], registry=r)
        self.decisions = Counter(
            "pdserve:proxy_prefill_decisions", "Where prompts were prefilled (path local|remote), and why.",
            ["role", "path", "reason"], registry=r,
        )
        self.retries = Counter("pdserve:proxy_prefill_retries", "Prefill legs retried.", ["role"], registry=r)
        self.peer_hints = Counter(
            "pdserve:proxy_peer_hints", "Legs sent with a peer hint (pdserve_peer_prefix, --kv-peer-fetch): another "
            "node holds more of the prompt's prefix than the node computing it.", ["role"], registry=r,
        )
        self.peer_hints.labels("proxy")  # exported at 0 from the start: a scrape tells none from not counted
        self.migrations = Counter(
            "pdserve:proxy_migrations", "Streams resumed on another node, by cause.", ["role", "cause"], registry=r
        )
        self.registry_rejected = Counter(
            "pdserve:proxy_registry_rejected", "Registry messages dropped, by reason.", ["role", "reason"],
            registry=r,
        )
        self.routes = Counter(
            "pdserve:proxy_route_decisions", "Nodes picked, by the node's role (prefill|decode) and why: prefix_events "
            "(the longest cached prefix by the nodes' KV events), prefix_text (by the text estimate), load, the "
            "policy's name (round_robin, least_loaded), or fair_share (every candidate saturated: the node where "
            "the request's client holds the fewest legs).", ["role", "node_role", "reason"], registry=r,
        )
        self.kv_index_blocks = Gauge(
            "pdserve:proxy_kv_index_blocks", "Block hashes in the index of the nodes' KV events.", ["role"], registry=r
        )
        self.kv_events_seq = Gauge(
            "pdserve:proxy_kv_events_applied_seq", "Per node, the last KV event batch applied to the index.",
            ["role", "node_type", "node"], registry=r,
        )
        self.kv_events_fresh = Gauge(
            "pdserve:proxy_kv_events_fresh", "Per node, 1 while its KV events are known complete (else its cache "
            "counts as unknown).", ["role", "node_type", "node"], registry=r,
        )
        self.kv_events_rejected = Counter(
            "pdserve:proxy_kv_events_rejected", "KV event messages dropped, by reason.", ["role", "reason"], registry=r
        )
        self._rejected_seen: dict[str, int] = {}
        self._kv_rejected_seen: dict[str, int] = {}
        # the children the request path touches, by label values: labels() validates and locks on every
        # call (~1.7 us, 5-7 calls a request); never for a metric that clear() empties at scrape
        self._children: dict[tuple, object] = {}

    def _child(self, metric, *values: str):
        key = (metric, values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def count_route(self, node_role: str, reason: str) -> None:
        self._child(self.routes, "proxy", node_role, reason).inc()

    def observe_kv_events(self, blocks: int, applied: Mapping[tuple[str, str], int],
                          fresh: Mapping[tuple[str, str], bool], rejected: Mapping[str, int]) -> None:
        """The KV event index's figures, refreshed at scrape (nodes gone since are dropped)."""
        self.kv_index_blocks.labels("proxy").set(blocks)
        self.kv_events_seq.clear()
        self.kv_events_fresh.clear()
        for (node_type, node), seq in applied.items():
            self.kv_events_seq.labels("proxy", node_type, node).set(seq)
            self.kv_events_fresh.labels("proxy", node_type, node).set(int(fresh.get((node_type, node), False)))
        for reason, total in rejected.items():
            delta = total - self._kv_rejected_seen.get(reason, 0)
            if delta > 0:
                self.kv_events_rejected.labels("proxy", reason).inc(delta)
            self._kv_rejected_seen[reason] = total

    def observe_request(self, status: int, latency_s: float) -> None:
        self._child(self.requests, "proxy", str(status)).inc()
        self._child(self.latency, "proxy").observe(latency_s)

    def observe_ttft(self, seconds: float) -> None:
        self._child(self.ttft, "proxy").observe(seconds)

    def count_leg(self, node_role: str, node: str) -> None:
        self._child(self.node_requests, node_role, node).inc()

    def count_error(self, kind: str) -> None:
        self._child(self.errors, "proxy", kind).inc()

    def count_decision(self, path: str, reason: str) -> None:
        self._child(self.decisions, "proxy", path, reason).inc()

    def count_migration(self, cause: str) -> None:
        self._child(self.migrations, "proxy", cause).inc()

    def count_retry(self) -> None:
        self._child(self.retries, "proxy").inc()

    def count_peer_hint(self) -> None:
        self._child(self.peer_hints, "proxy").inc()

    def render(self, node_counts: Mapping[str, int], rejected: Mapping[str, int] | None = None) -> bytes:
        """Prometheus text; the node gauge and the registry's reject counts are refreshed here."""
        for node_type in ("P", "D"):
            self.registered.labels("proxy", node_type).set(node_counts.get(node_type, 0))
        for reason, total in dict(rejected or {}).items():
            delta = total - self._rejected_seen.get(reason, 0)
            if delta > 0:
                self.registry_rejected.labels("proxy", reason).inc(delta)
            self._rejected_seen[reason] = total
        return generate_latest(self.registry)


class StreamWatch:
    """Reads the SSE bytes the proxy relays (never changing them) for two moments: the first
    content token (what clients time as TTFT; the chat role chunk carries none) and ``[DONE]``
    (after which a client that hangs up has not cut the request short)."""

    _CARRY = 1 << 16  # an event split across reads is kept at most this long

    def __init__(self) -> None:
        self.first_content_seen = False
        self.done = False
        self._partial = b""

    def feed(self, chunk: bytes) -> bool:
        """Note ``chunk``; True when it completes the stream's first content event."""
        if self.done:
            return False
        data = self._partial + chunk
        if self.first_content_seen:  # only [DONE] is left to find: no JSON parsing from here
            self.done = b"data: [DONE]" in data
            self._partial = data[-16:]
            return False
        *events, self._partial = data.split(b"\n\n")
        if len(self._partial) > self._CARRY:
            self._partial = b""
        found = False
        for event in events:
            for line in event.split(b"\n"):
                payload = line[5:].strip() if line.startswith(b"data:") else None
                if payload == b"[DONE]":
                    self.done = True
                elif payload and not self.first_content_seen and _has_content(payload):
                    self.first_content_seen = found = True
        return found


def _has_content(payload: bytes) -> bool:
    try:
        event = json.loads(payload)
    except ValueError:
        return False
    choices = event.get("choices") if isinstance(event, dict) else None
    for choice in choices if isinstance(choices, list) else []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta")
        if choice.get("text"):
            return True
        if isinstance(delta, dict) and (delta.get("content") or delta.get("tool_calls")):
            return True
    return False
