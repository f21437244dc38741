"""Fair share at the proxy (proxy/fair_share.py): when every candidate node is saturated, a
client's request goes where that client holds least, then to the least loaded; otherwise, or with
one client, the policy's pick stands."""

from __future__ import annotations

from common.registry_client import RegistrationMessage
from proxy.fair_share import client_of
from proxy.registry import ServiceRegistry
from proxy.routing import Pair, Router


def node(kind: str, port: int, **load) -> RegistrationMessage:
    return RegistrationMessage(kind, f"127.0.0.1:{port}", f"127.0.0.1:{port + 1000}", model="m",
                               kv_fingerprint="fp", **load)


def router_with(*nodes: RegistrationMessage, policy: str = "prefix_aware") -> tuple[Router, list[tuple[str, str]]]:
    registry = ServiceRegistry(port=0)  # never started: the table is enough here
    for n in nodes:
        registry.register(n)
    router = Router(registry, policy)
    routes: list[tuple[str, str]] = []
    router.on_route = lambda role, reason: routes.append((role, reason))
    return router, routes


FULL = {"num_running": 4, "num_waiting": 2}  # a heartbeat of a node with every slot taken
D1, D2 = "127.0.0.1:11", "127.0.0.1:12"


def send(router: Router, client: str, prompt: str = "the same long prompt " * 8) -> Pair:
    pair = router.pick("m", prompt=prompt, client=client)
    router.begin(pair)
    return pair


def test_a_clients_flood_is_spread_over_saturated_nodes_and_the_move_is_counted():
    """prefix_aware sends one prompt back to the node that saw it; with every node saturated and
    another client in flight, client A's requests alternate instead."""
    r, routes = router_with(node("P", 1, **FULL), node("D", 11, **FULL), node("D", 12, **FULL))
    send(r, "B", prompt="something else entirely")
    decodes = [send(r, "A").decode.http_address for _ in range(6)]
    assert sorted(decodes) == [D1] * 3 + [D2] * 3
    assert ("decode", "fair_share") in routes
    assert not any(role == "prefill" and reason == "fair_share" for role, reason in routes)  # one P: nowhere to move


def test_another_clients_request_goes_where_the_flood_holds_least():
    """round_robin would send B to D1, where A's flood is, and A back there every other time."""
    r, _ = router_with(node("P", 1, **FULL), node("D", 11, **FULL), node("D", 12, **FULL), policy="round_robin")
    flood = Pair(r.pick("m").prefill, node("D", 11), "A")
    for _ in range(5):
        r.begin(flood)  # A's legs all on D1 (e.g. sent before the nodes filled up)
    assert send(r, "B").decode.http_address == D2  # B holds nothing anywhere: the least loaded
    assert [send(r, "A").decode.http_address for _ in range(2)] == [D2, D2]  # A holds 5 on D1


def test_the_policy_stands_while_a_node_has_room():
    """One candidate not saturated: the prefix policy's pick stands even if it is full."""
    r, routes = router_with(node("P", 1), node("D", 11, **FULL), node("D", 12, num_running=1))
    send(r, "B", prompt="something else entirely")
    decodes = {send(r, "A").decode.http_address for _ in range(4)}
    assert len(decodes) == 1
    assert ("decode", "fair_share") not in routes


def test_one_client_keeps_the_policys_pick():
    """With one client in flight there is no one to be fair to: prefix affinity stays."""
    r, routes = router_with(node("P", 1, **FULL), node("D", 11, **FULL), node("D", 12, **FULL))
    decodes = {send(r, "A").decode.http_address for _ in range(4)}
    assert len(decodes) == 1
    assert not any(reason == "fair_share" for _, reason in routes)


def test_end_gives_the_clients_legs_back():
    r, _ = router_with(node("P", 1, **FULL), node("D", 11, **FULL), node("D", 12, **FULL))
    b = send(r, "B", prompt="something else entirely")
    pairs = [send(r, "A") for _ in range(2)]
    assert {p.decode.http_address for p in pairs} == {D1, D2}
    for p in pairs + [b]:
        r.end(p)
    assert r._client_legs.holds(("D", D1), "A") == 0 and not r._client_legs.shared("A")


def test_the_prefill_pick_is_shared_too():
    r, routes = router_with(node("P", 1, **FULL), node("P", 2, **FULL), node("D", 11))
    send(r, "B", prompt="something else entirely")
    prefills = [send(r, "A").prefill.http_address for _ in range(4)]
    assert sorted(prefills) == ["127.0.0.1:1"] * 2 + ["127.0.0.1:2"] * 2
    assert ("prefill", "fair_share") in routes


def test_client_identity_follows_the_nodes_order():
    body = {"cache_salt": "tenant-1", "user": "alice"}
    by_key = client_of("Bearer key-A", body)
    assert by_key.startswith("key:") and "key-A" not in by_key  # only a hash is kept
    assert by_key == client_of("bearer  key-A ", {})
    assert by_key != client_of("Bearer key-B", body)
    assert client_of("Bearer proxy-key", body, proxy_key="proxy-key") == "salt:tenant-1"  # the gate names no one
    assert client_of(None, {"user": "alice"}) == "user:alice"
    assert client_of("Basic abc", {"user": 7}) == ""
