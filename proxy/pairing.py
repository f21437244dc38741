"""Registered nodes that no live peer can pair with, and why: shown in the proxy's ``/ready``.

A node that heartbeats is registered, but it serves nothing while no node of the other role
shares its model and KV layout (``kv_fingerprint``), or none of those can take its KV heads
the way the TP sizes need (``routing.heads_route``: e.g. a decode node of TP 2 beside a prefill
node of TP 1 without ``--kv-ranks 2``). The router never picks such a node; ``PairingWatch``
says so where a user looks: ``/ready`` lists it under ``unpaired`` with the reason (the node
counts as not ready for its role), and the proxy logs a warning when a node becomes unpaired
and a line when it pairs again. The check runs once per membership change.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from common.registry_client import RegistrationMessage
from proxy.registry import Group, Node
from proxy.routing import heads_route

logger = logging.getLogger(__name__)
_ROLE = {"P": "prefill", "D": "decode"}
_SHOWN = 4  # peers named in a reason


@dataclass(frozen=True)
class Unpaired:
    """A registered node that no live peer can pair with."""

    type: str  # "P" | "D"
    http_address: str
    reason: str

    def to_dict(self) -> dict[str, str]:
        return asdict(self)


def unpaired(groups: tuple[Group, ...]) -> list[Unpaired]:
    """Every registered node without a partner, with the reason; [] when all can serve."""
    everyone = {"P": [n for g in groups for n in g.prefills], "D": [n for g in groups for n in g.decodes]}
    out: list[Unpaired] = []
    for group in groups:
        for node, peers in [*((p, group.decodes) for p in group.prefills), *((d, group.prefills) for d in group.decodes)]:
            if not any(_routes(node.info, peer) for peer in _distinct(peers)):
                out.append(Unpaired(node.info.type, node.info.http_address, _reason(node, peers, everyone)))
    return out


class PairingWatch:
    """The unpaired nodes of the registry's current membership, logged when they change."""

    def __init__(self) -> None:
        self._groups: tuple[Group, ...] | None = None
        self._unpaired: list[Unpaired] = []

    def check(self, groups: tuple[Group, ...]) -> list[Unpaired]:
        if groups is self._groups:  # the registry hands out the same snapshot until membership changes
            return self._unpaired
        now = unpaired(groups)
        before = {(u.type, u.http_address) for u in self._unpaired}
        after = {(u.type, u.http_address) for u in now}
        for u in now:
            if (u.type, u.http_address) not in before:
                logger.warning("%s node %s is registered but not ready for its role: %s", _ROLE[u.type],
                               u.http_address, u.reason)
        live = {n.key for g in groups for n in (*g.prefills, *g.decodes)}
        for kind, address in sorted((before - after) & live):
            logger.info("%s node %s can pair again", _ROLE[kind], address)
        self._groups, self._unpaired = groups, now
        return now


def _routes(node: RegistrationMessage, peer: RegistrationMessage) -> bool:
    return heads_route(node, peer) if node.type == "P" else heads_route(peer, node)


def _distinct(peers: Iterable[Node]) -> list[RegistrationMessage]:
    """One peer per KV shape: pairing depends only on TP size, KV ranks and KV heads."""
    seen: dict[tuple, RegistrationMessage] = {}
    for peer in peers:
        seen.setdefault((peer.info.tp_size, peer.info.kv_ranks, peer.info.kv_heads), peer.info)
    return list(seen.values())


def _reason(node: Node, peers: tuple[Node, ...], everyone: dict[str, list[Node]]) -> str:
    other = "D" if node.info.type == "P" else "P"
    role = _ROLE[other]
    if not everyone[other]:
        return f"no {role} node is registered"
    if not peers:
        return (f"no {role} node serves its model {node.info.model!r} with its KV layout "
                f"({node.info.kv_fingerprint}); {role} nodes registered: {_describe(everyone[other])}")
    return (f"its {_shape(node.info)} cannot exchange KV with any {role} node of its model "
            f"({_describe(peers)}): a prefill node's TP size (or --kv-ranks) must equal the decode node's or "
            f"be a multiple of it, splitting the KV heads evenly")


def _shape(info: RegistrationMessage) -> str:
    shape = f"TP size {info.tp_size or 1}"
    if info.kv_ranks:
        shape += f" with {info.kv_ranks} KV ranks"
    return shape + (f" over {info.kv_heads} KV heads" if info.kv_heads else "")


def _describe(nodes: Iterable[Node]) -> str:
    nodes = list(nodes)
    shown = ", ".join(f"{n.info.http_address} ({n.info.model}, {_shape(n.info)})" for n in nodes[:_SHOWN])
    return shown + (f" and {len(nodes) - _SHOWN} more" if len(nodes) > _SHOWN else "")
