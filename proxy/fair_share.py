"""Fair share between clients at the proxy: where a client's request goes when every node is full.

The nodes share their engine between clients (``common/engine/fairness.py``); that holds per
node. The router adds one rule for when it has no free node to offer: when the policy's pick is
saturated, more than one client has requests in flight, and every candidate node is saturated
too, the request goes to the node where its client holds the fewest legs in flight from this
proxy, then the least loaded (``least_loaded``'s measure), instead of the policy's pick. A
client's flood is so spread evenly over the nodes rather than piled on the one its prefix or
the round-robin turn names, and another client's request goes where the others' queues are
shortest; each node's fair share then sees every active client, so the per-node shares add up
to an even share of the cluster.

A node is saturated when its last heartbeat says requests wait (``num_waiting > 0``): every
slot (``--max-num-seqs``) or its KV blocks are taken. A decode node counts the requests parked
for a peer's KV as waiting too, so a busy disaggregated decode node reads saturated sooner; the
rule only spreads each client's own requests, as the load-based policies do anyway. With one
client in flight, or a free node among the candidates, the policy's pick stands, untouched.

Who a client is, as the nodes read it (``common/serving/client_id.py``): the bearer token of the
``Authorization`` header (a hash of it), unless it is the proxy's own ``--api-key`` (a gate every
client passes, not an identity), else the body's ``cache_salt`` (``--cache-salt-from-api-key``
sets it from the client's key), else its ``user`` field, else "" (one shared pool).
"""

from __future__ import annotations

import hashlib
from collections import Counter

from proxy.api_key import bearer_token
from proxy.registry import Node


def client_of(authorization: str | None, body: dict, proxy_key: str | None = None) -> str:
    """Who sent ``body``: ``key:<hash>``, ``salt:<salt>``, ``user:<user>`` or "" (see above)."""
    if authorization:
        token = bearer_token(authorization.encode("latin-1", "replace"))
        if token and (proxy_key is None or token != proxy_key.encode()):
            return "key:" + hashlib.blake2b(token, digest_size=16).hexdigest()
    salt = body.get("cache_salt")
    if isinstance(salt, str) and salt:
        return "salt:" + salt
    user = body.get("user")
    if isinstance(user, str) and user:
        return "user:" + user
    return ""


def saturated(node: Node) -> bool:
    """The node's last heartbeat says requests wait: its slots or its KV blocks are all taken."""
    return node.info.num_waiting > 0


class ClientLegs:
    """Legs in flight from this proxy, per (node, client); the router counts them at ``begin`` and
    ``end`` and asks :meth:`choose` when its policy's pick is saturated."""

    def __init__(self) -> None:
        # plain dicts, written out: this runs twice per leg, on every request
        self._legs: dict[tuple[tuple[str, str], str], int] = {}  # ((type, http_address), client) -> legs
        self._clients: dict[str, int] = {}  # client -> its legs on any node

    def add(self, key: tuple[str, str], client: str) -> None:
        legs, clients, k = self._legs, self._clients, (key, client)
        legs[k] = legs.get(k, 0) + 1
        clients[client] = clients.get(client, 0) + 1

    def remove(self, key: tuple[str, str], client: str) -> None:
        legs, clients, k = self._legs, self._clients, (key, client)
        n = legs.get(k, 0) - 1
        if n > 0:
            legs[k] = n
        else:
            legs.pop(k, None)
        n = clients.get(client, 0) - 1
        if n > 0:
            clients[client] = n
        else:
            clients.pop(client, None)

    def holds(self, key: tuple[str, str], client: str) -> int:
        return self._legs.get((key, client), 0)

    def shared(self, client: str) -> bool:
        """Some other client than ``client`` has legs in flight."""
        return len(self._clients) > 1 or (len(self._clients) == 1 and client not in self._clients)

    def choose(self, picked: Node, nodes: list[Node], client: str, inflight: Counter) -> Node | None:
        """The node for ``client`` when ``picked`` (the policy's) is saturated and so is every other
        of ``nodes``: where ``client`` holds least, then the least loaded, ``picked`` on a tie. None
        when the policy's pick stands (a free node among ``nodes``, one client, or ``picked`` best)."""
        if len(nodes) < 2 or not self.shared(client) or not all(saturated(n) for n in nodes):
            return None

        def key(n: Node) -> tuple:
            own = self.holds(n.key, client)
            return (own, n.info.load + inflight[n.key] - own, n is not picked)

        best = min(nodes, key=key)
        return None if best is picked else best
