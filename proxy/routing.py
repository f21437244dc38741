"""Choosing a (prefill, decode) pair.

P and D are each chosen by the policy among their own candidates; the only link
between the two choices is compatibility: same model and same KV layout
fingerprint (a vLLM-format node reports neither, and pairs only with another
such node). A request naming a model goes to nodes serving it; vLLM-format nodes
cannot say what they serve, so they are candidates for any model.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from common.kv_topology import KVTopology, plan
from common.registry_client import RegistrationMessage
from common.serving.errors import model_not_served
from proxy.errors import ModelNotFound, NoNodeAvailable, ProxyError
from proxy.exact_prefix import ExactPrefix
from proxy.fair_share import ClientLegs, saturated
from proxy.prefix_policy import PrefixAware
from proxy.registry import Group, GroupKey, Node, ServiceRegistry


def heads_route(p: RegistrationMessage, d: RegistrationMessage) -> bool:
    """P's KV heads route to D's ranks (``kv_topology.plan``) and the daemons can move them. What
    counts on P's side is its KV ranks: one per rank, or ``--kv-ranks`` (each rank's heads cut in
    slices, ``tp_slices``). KV rank r goes to decode rank r at equal counts (``tp_ranks``); each
    KV rank's whole set of heads goes to one decode rank when P's count is a multiple of D's TP
    size (``tp_routes``). A node that does not say its TP size (vLLM-format, or older) counts as
    one rank. The model and the whole model's KV layout (``kv_fingerprint``) are matched by the
    registry's groups."""
    a, b = p.kv_ranks or p.tp_size or 1, d.tp_size or 1
    if a != b and (a % b or p.kv_heads is None or p.kv_heads % a):
        return False  # a KV rank's heads would split over decode ranks (run P with --kv-ranks b)
    if p.kv_heads is None or d.kv_heads is None:
        return True
    try:
        plan(KVTopology(a, p.kv_heads), KVTopology(b, d.kv_heads))
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Pair:
    prefill: RegistrationMessage
    decode: RegistrationMessage
    client: str = ""  # whom it was picked for (proxy/fair_share.py): its legs count as that client's


class Policy(Protocol):
    """Picks one of ``nodes``: never empty, sorted by http_address, shared (read, do not change).
    ``prompt`` is the request's text (prefix_aware reads it)."""

    def choose(self, nodes: list[Node], inflight: Counter, prompt: str = "") -> Node: ...


class RoundRobin:
    """Each role's own counter walks its candidates in address order (the router hands them
    over sorted, so a pick costs the same for 2 nodes or 2,000)."""

    def __init__(self) -> None:
        self._counter = itertools.count()

    def choose(self, nodes: list[Node], inflight: Counter, prompt: str = "") -> Node:
        return nodes[next(self._counter) % len(nodes)]


class LeastLoaded:
    """Fewest requests, from the last heartbeat plus what this proxy sent since.

    The heartbeat is up to an interval old; without the proxy's own in-flight count,
    a burst between two heartbeats would all land on the same node.
    """

    def choose(self, nodes: list[Node], inflight: Counter, prompt: str = "") -> Node:
        def score(n: Node) -> tuple:
            free = n.info.num_free_blocks if n.info.num_free_blocks is not None else 0
            return (n.info.load + inflight[n.key], -free, n.info.http_address)

        return min(nodes, key=score)


def make_policy(name: str) -> Policy:
    if name == "round_robin":
        return RoundRobin()
    if name == "least_loaded":
        return LeastLoaded()
    if name == "prefix_aware":
        return PrefixAware()
    raise ValueError(f"unknown routing policy {name!r}: use round_robin, least_loaded or prefix_aware")


class Router:
    """Picks pairs from the registry and counts the legs in flight on each node.

    Cost per request: one pass over the registry's (model, fingerprint) groups, the
    policy's pass over the prefill candidates, then over the chosen group's decodes --
    never P x D. Candidate lists are cached until the registry's membership changes.
    """

    def __init__(self, registry: ServiceRegistry, policy: str = "round_robin",
                 stall_limit_s: float = float("inf"), cooldown_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic, exact: ExactPrefix | None = None):
        self.registry = registry
        self.policy_name = policy
        self.on_route: Callable[[str, str], None] | None = None  # (role, reason) of each pick: a metric
        self.stall_limit_s = stall_limit_s  # a node stuck in one engine step this long gets no new work
        self.cooldown_s = cooldown_s  # a node a leg could not reach gets no new work this long
        self._clock = clock
        self._cooling: dict[tuple[str, str], float] = {}  # (type, http_address) -> end of its cool-down
        self._prefill_policy = make_policy(policy)
        self._decode_policy = make_policy(policy)
        for p in (self._prefill_policy, self._decode_policy):
            if isinstance(p, PrefixAware):
                p.exact = exact
        self._inflight: Counter = Counter()
        self._client_legs = ClientLegs()  # the same legs by client: fair share when every node is full
        self._cache: tuple[tuple[Group, ...], dict[str | None, _Candidates]] = ((), {})

    def pick(self, model: str | None, exclude_prefill: frozenset[str] = frozenset(),
             prompt: str = "", exclude_decode: frozenset[str] = frozenset(), client: str = "") -> Pair:
        """A compatible pair for ``model`` (``prompt``: its text, for prefix_aware; ``client``: who
        sends it, for fair share when every node is saturated); raises NoNodeAvailable or ModelNotFound."""
        c = self._candidates(model)
        prefills = c.prefills
        if exclude_prefill:
            prefills = [n for n in prefills if n.info.http_address not in exclude_prefill]
        if not prefills:
            if c.error is not None:
                raise type(c.error)(c.error.message)  # a fresh one each time: no traceback pile-up
            raise NoNodeAvailable("no prefill node is registered (besides ones that just failed)")
        p = self._choose(self._prefill_policy, prefills, prompt, "prefill", client)
        decodes = c.decodes_of[p.group, p.info.tp_size]
        if exclude_decode:
            decodes = [n for n in decodes if n.info.http_address not in exclude_decode]
            if not decodes:
                raise NoNodeAvailable("no decode node is registered (besides ones that just failed)")
        d = self._choose(self._decode_policy, decodes, prompt, "decode", client)
        return Pair(p.info, d.info, client)

    def pick_decode(self, model: str | None, prompt: str = "",
                    exclude_decode: frozenset[str] = frozenset(), client: str = "") -> Pair:
        """A decode node for ``model`` that computes the prompt itself, for when no prefill node is
        registered: ``Pair(d, d)``, to be sent with a local prefill (the decode leg only). Raises
        NoNodeAvailable when there is none either."""
        decodes = sorted((d for g in self.registry.groups() if model is None or g.model is None or g.model == model
                          for d in g.decodes if d.info.http_address not in exclude_decode),
                         key=lambda n: n.info.http_address)
        if not decodes:
            raise NoNodeAvailable("no prefill and no decode node is registered (besides ones that just failed)")
        d = self._choose(self._decode_policy, decodes, prompt, "decode", client)
        return Pair(d.info, d.info, client)

    def _choose(self, policy: Policy, nodes: list[Node], prompt: str, role: str, client: str) -> Node:
        """The policy's pick among ``nodes``, skipping any whose engine is stuck past the stall
        limit, and any a leg just failed to reach while another can take the request (checked on
        the pick first, so the common case costs no pass over the list); when that pick is
        saturated, fair share between clients may move it (``proxy/fair_share.py``). ``on_route``
        hears the role and the reason of each pick (``fair_share`` for a moved one)."""
        node, reason = self._ask(policy, nodes, prompt)
        stalled = self.registry.stalled_for(node) >= self.stall_limit_s
        pool = nodes
        if stalled or self._cooling_down(node):
            live = [n for n in nodes if self.registry.stalled_for(n) < self.stall_limit_s]
            if not live:
                raise NoNodeAvailable(f"every compatible {role} node is stalled (its engine has made no "
                                      f"progress for {self.stall_limit_s:g} s, --node-stall-timeout-s)")
            pool = reachable = [n for n in live if not self._cooling_down(n)]
            if reachable:
                node, reason = self._ask(policy, reachable, prompt)
            else:  # all cooling: try anyway
                pool = live
                if stalled:
                    node, reason = self._ask(policy, live, prompt)
        if saturated(node):  # the one check a request pays while its node has a free slot
            fair = self._client_legs.choose(node, pool, client, self._inflight)
            if fair is not None:
                node, reason = fair, "fair_share"
        if self.on_route is not None:
            self.on_route(role, reason)
        return node

    def _ask(self, policy: Policy, nodes: list[Node], prompt: str) -> tuple[Node, str]:
        if isinstance(policy, PrefixAware):
            return policy.choose_with_reason(nodes, self._inflight, prompt)
        return policy.choose(nodes, self._inflight, prompt), self.policy_name

    def unreachable(self, role: str, http_address: str) -> None:
        """A ``role`` ("prefill" / "decode") leg could not reach this node (refused, reset, connect
        timeout): until ``cooldown_s`` passes it gets no new request another node can take, so a
        node killed outright stops failing requests before its heartbeats time out."""
        if self.cooldown_s <= 0:
            return
        now = self._clock()
        if len(self._cooling) > 4096:  # addresses come from the registry, but keep it bounded
            self._cooling = {k: t for k, t in self._cooling.items() if t > now}
        self._cooling[("P" if role == "prefill" else "D", http_address)] = now + self.cooldown_s

    def _cooling_down(self, node: Node) -> bool:
        until = self._cooling.get(node.key)
        if until is None:
            return False
        if self._clock() < until:
            return True
        del self._cooling[node.key]
        return False

    def has_pair(self) -> bool:
        """True when at least one compatible (P, D) pair is registered (readiness)."""
        return bool(self._candidates(None).prefills)

    def models(self) -> list[str]:
        return sorted({g.model for g in self.registry.groups() if g.model})

    def in_flight(self, node_type: str, http_address: str) -> int:
        """This proxy's legs in flight on one node (``node_type`` "P" or "D"): fresher than its
        heartbeat, which at one client still counts the request that just ended."""
        return self._inflight[(node_type, http_address)]

    def begin(self, pair: Pair, local: bool = False) -> None:
        """Count the legs (only D's for a ``local`` prefill) as in flight until ``end``, in all and
        as ``pair.client``'s."""
        for key in _leg_keys(pair, local):
            self._inflight[key] += 1
            self._client_legs.add(key, pair.client)

    def end(self, pair: Pair, local: bool = False) -> None:
        for key in _leg_keys(pair, local):
            self._inflight[key] -= 1
            if self._inflight[key] <= 0:
                del self._inflight[key]
            self._client_legs.remove(key, pair.client)

    def _candidates(self, model: str | None) -> _Candidates:
        groups = self.registry.groups()
        if groups is not self._cache[0]:
            self._cache = (groups, {})
            live = {n.key for g in groups for n in (*g.prefills, *g.decodes)}
            for policy in (self._prefill_policy, self._decode_policy):
                if isinstance(policy, PrefixAware):
                    policy.forget_all_but(live)  # nodes come and go: their memories must not pile up
        by_model = self._cache[1]
        if model not in by_model:
            if len(by_model) > 256:  # model names come from clients: keep the cache bounded
                by_model.clear()
            by_model[model] = _Candidates.of(groups, model)
        return by_model[model]


@dataclass
class _Candidates:
    """For one requested model: prefills that have a partner, the decodes each can pair with
    (by its group and TP size: ``heads_route``), or the error."""

    prefills: list[Node]  # sorted by address; policies read, never change, these lists
    decodes_of: dict[tuple[GroupKey, int | None], list[Node]]
    error: ProxyError | None

    @classmethod
    def of(cls, groups: tuple[Group, ...], model: str | None) -> _Candidates:
        all_p = [n for g in groups for n in g.prefills]
        all_d = [n for g in groups for n in g.decodes]
        serving = [g for g in groups if model is None or g.model is None or g.model == model]
        decodes_of: dict[tuple[GroupKey, int | None], list[Node]] = {}
        for g in serving:
            for p in g.prefills:
                key = (p.group, p.info.tp_size)
                if key not in decodes_of:
                    decodes_of[key] = [d for d in g.decodes if heads_route(p.info, d.info)]
        decodes_of = {key: ds for key, ds in decodes_of.items() if ds}
        error: ProxyError | None = None
        if not all_p:
            error = NoNodeAvailable("no prefill node is registered")
        elif not all_d:
            error = NoNodeAvailable("no decode node is registered")
        elif not serving:
            error = ModelNotFound(model_not_served(model, sorted({g.model for g in groups if g.model})))
        elif not any(g.prefills for g in serving) or not any(g.decodes for g in serving):
            missing = "decode" if any(g.prefills for g in serving) else "prefill"
            error = NoNodeAvailable(f"no {missing} node serving model {model!r} is registered")
        elif not decodes_of:
            ps = [n for g in serving for n in g.prefills]
            ds = [n for g in serving for n in g.decodes]
            error = NoNodeAvailable(f"no compatible prefill/decode pair: {_describe(ps)} vs {_describe(ds)}"
                                    " (model and KV layout fingerprint must match, and prefill's TP size (or"
                                    " --kv-ranks) must equal decode's or be a multiple of it, splitting the KV"
                                    " heads evenly)")
        prefills = sorted((p for g in serving for p in g.prefills if (p.group, p.info.tp_size) in decodes_of),
                          key=lambda n: n.info.http_address)
        return cls(prefills, decodes_of, error)


def _leg_keys(pair: Pair, local: bool) -> list[tuple[str, str]]:
    decode = ("D", pair.decode.http_address)
    return [decode] if local else [("P", pair.prefill.http_address), decode]


def _describe(nodes: list[Node]) -> str:
    return ", ".join(f"{n.info.http_address}({n.info.model}, {n.info.kv_fingerprint}"
                     + (f", TP {n.info.tp_size or 1} over {n.info.kv_heads} KV heads" if n.info.kv_heads else "")
                     + (f", {n.info.kv_ranks} KV ranks" if n.info.kv_ranks else "")
                     + (f", block size {n.info.block_size}" if n.info.block_size else "")
                     + ")" for n in nodes)
