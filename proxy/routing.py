"""Choosing a (prefill, decode) pair.

P and D are each chosen by the policy among their own candidates; the only link
between the two choices is compatibility: same model and same KV layout
fingerprint (a vLLM-format node reports neither, and pairs only with another
such node). A request naming a model goes to nodes serving it; vLLM-format nodes
cannot say what they serve, so they are candidates for any model.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass
from typing import Protocol

from common.registry_client import RegistrationMessage
from proxy.errors import ModelNotFound, NoNodeAvailable
from proxy.registry import Node, ServiceRegistry


def compatible(p: RegistrationMessage, d: RegistrationMessage) -> bool:
    return p.model == d.model and p.kv_fingerprint == d.kv_fingerprint


@dataclass(frozen=True)
class Pair:
    prefill: RegistrationMessage
    decode: RegistrationMessage


class Policy(Protocol):
    def choose(self, nodes: list[Node], inflight: Counter) -> Node: ...


class RoundRobin:
    """Each role's own counter walks its candidates in address order."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, nodes: list[Node], inflight: Counter) -> Node:
        ordered = sorted(nodes, key=lambda n: n.info.http_address)
        return ordered[next(self._counter) % len(ordered)]


class LeastLoaded:
    """Fewest requests, from the last heartbeat plus what this proxy sent since.

    The heartbeat is up to an interval old; without the proxy's own in-flight count,
    a burst between two heartbeats would all land on the same node.
    """

    def choose(self, nodes: list[Node], inflight: Counter) -> Node:
        def score(n: Node) -> tuple:
            free = n.info.num_free_blocks if n.info.num_free_blocks is not None else 0
            return (n.info.load + inflight[n.key], -free, n.info.http_address)

        return min(nodes, key=score)


def make_policy(name: str) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    raise ValueError(f"unknown routing policy {name!r}: use round_robin or least_loaded")


class Router:
    """Picks pairs from the registry and counts the legs in flight on each node."""

    def __init__(self, registry: ServiceRegistry, policy: str = "round_robin"):
        self.registry = registry
        self._prefill_policy = make_policy(policy)
        self._decode_policy = make_policy(policy)
        self._inflight: Counter = Counter()

    def pick(self, model: str | None, exclude_prefill: frozenset[str] = frozenset()) -> Pair:
        """A compatible pair for ``model``; raises NoNodeAvailable or ModelNotFound."""
        prefills = [n for n in self.registry.nodes("P") if n.info.http_address not in exclude_prefill]
        decodes = self.registry.nodes("D")
        if not prefills:
            raise NoNodeAvailable("no prefill node is registered" + (" (besides ones that just failed)"
                                                                      if exclude_prefill else ""))
        if not decodes:
            raise NoNodeAvailable("no decode node is registered")
        prefills, decodes = _serving(prefills, model), _serving(decodes, model)
        if not prefills or not decodes:
            raise ModelNotFound(f"the model {model!r} is not served here; see /v1/models")
        usable_p = [p for p in prefills if any(compatible(p.info, d.info) for d in decodes)]
        if not usable_p:
            raise NoNodeAvailable(f"no compatible prefill/decode pair: {_describe(prefills)} vs {_describe(decodes)}"
                                  " (model and KV layout fingerprint must match)")
        p = self._prefill_policy.choose(usable_p, self._inflight)
        d = self._decode_policy.choose([d for d in decodes if compatible(p.info, d.info)], self._inflight)
        return Pair(p.info, d.info)

    def has_pair(self) -> bool:
        """True when at least one compatible (P, D) pair is registered (readiness)."""
        decodes = self.registry.nodes("D")
        return any(compatible(p.info, d.info) for p in self.registry.nodes("P") for d in decodes)

    def models(self) -> list[str]:
        return sorted({n.info.model for n in self.registry.nodes() if n.info.model})

    def begin(self, pair: Pair) -> None:
        """Count both legs as in flight (least-loaded reads it) until ``end(pair)``."""
        self._inflight[("P", pair.prefill.http_address)] += 1
        self._inflight[("D", pair.decode.http_address)] += 1

    def end(self, pair: Pair) -> None:
        for key in (("P", pair.prefill.http_address), ("D", pair.decode.http_address)):
            self._inflight[key] -= 1
            if self._inflight[key] <= 0:
                del self._inflight[key]


def _serving(nodes: list[Node], model: str | None) -> list[Node]:
    if model is None:
        return nodes
    return [n for n in nodes if n.info.model is None or n.info.model == model]


def _describe(nodes: list[Node]) -> str:
    return ", ".join(f"{n.info.http_address}({n.info.model}, {n.info.kv_fingerprint})" for n in nodes)
