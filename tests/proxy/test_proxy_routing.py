"""Pair choice: round-robin, least-loaded, compatibility, and the errors when none fits."""

from __future__ import annotations

from collections import Counter

import pytest

from common.registry_client import RegistrationMessage
from proxy.errors import ModelNotFound, NoNodeAvailable
from proxy.registry import ServiceRegistry
from proxy.routing import Router


def node(kind: str, port: int, model: str | None = "m", fp: str | None = "fp", **load) -> RegistrationMessage:
    return RegistrationMessage(kind, f"127.0.0.1:{port}", f"127.0.0.1:{port + 1000}", model=model,
                               kv_fingerprint=fp, **load)


def router_with(*nodes: RegistrationMessage, policy: str = "round_robin") -> Router:
    registry = ServiceRegistry(port=0)  # never started: the table is enough here
    for n in nodes:
        registry.register(n)
    return Router(registry, policy)


def test_round_robin_alternates_each_role_independently():
    r = router_with(node("P", 1), node("P", 2), node("D", 11), node("D", 12), node("D", 13))
    pairs = [r.pick("m") for _ in range(6)]
    assert Counter(p.prefill.http_address for p in pairs) == {"127.0.0.1:1": 3, "127.0.0.1:2": 3}
    assert Counter(p.decode.http_address for p in pairs) == {f"127.0.0.1:{i}": 2 for i in (11, 12, 13)}


def test_least_loaded_uses_heartbeat_load_then_inflight():
    r = router_with(node("P", 1, num_running=4), node("P", 2, num_waiting=1),
                    node("D", 11, num_running=1), node("D", 12, num_running=1, num_free_blocks=50),
                    policy="least_loaded")
    first = r.pick("m")
    assert first.prefill.http_address == "127.0.0.1:2"
    assert first.decode.http_address == "127.0.0.1:12"  # equal load: more free KV blocks wins
    r.begin(first)  # in flight now: the next pick sees it before any heartbeat does
    second = r.pick("m")
    assert second.decode.http_address == "127.0.0.1:11"
    r.end(first)
    assert r.pick("m").decode.http_address == "127.0.0.1:12"


def test_in_flight_counts_this_proxys_legs_per_node_for_the_disagg_policy():
    """--disagg-policy auto reads how many requests decode on D from here (proxy/relay.py wires
    Router.in_flight into DisaggPolicy.in_flight): a local prefill counts only D's leg."""
    r = router_with(node("P", 1), node("D", 11))
    pair = r.pick("m")
    assert r.in_flight("D", "127.0.0.1:11") == 0
    r.begin(pair)
    r.begin(pair, local=True)
    assert (r.in_flight("D", "127.0.0.1:11"), r.in_flight("P", "127.0.0.1:1")) == (2, 1)
    r.end(pair)
    r.end(pair, local=True)
    assert (r.in_flight("D", "127.0.0.1:11"), r.in_flight("P", "127.0.0.1:1")) == (0, 0)


def test_incompatible_fingerprints_are_never_paired():
    r = router_with(node("P", 1, fp="A"), node("P", 2, fp="B"), node("D", 11, fp="B"))
    for _ in range(5):
        assert r.pick("m").prefill.http_address == "127.0.0.1:2"
    r2 = router_with(node("P", 1, fp="A"), node("D", 11, fp="B"))
    with pytest.raises(NoNodeAvailable, match="no compatible prefill/decode pair"):
        r2.pick("m")
    assert not r2.has_pair()


def test_nodes_of_different_models_are_never_paired():
    """The same KV layout is not enough: a prefill node of one model never serves another's decode node."""
    r = router_with(node("P", 1, model="a"), node("P", 2, model="b"), node("D", 11, model="b"))
    for _ in range(5):
        assert r.pick("b").prefill.http_address == "127.0.0.1:2"
    # model a is served, only not by a decode node: a 503 saying so, not a 404 saying a does not exist
    with pytest.raises(NoNodeAvailable, match="no decode node serving model 'a'"):
        router_with(node("P", 1, model="a"), node("D", 11, model="b")).pick("a")
    with pytest.raises(NoNodeAvailable, match="no prefill node serving model 'b'"):
        router_with(node("P", 1, model="a"), node("D", 11, model="a"), node("D", 12, model="b")).pick("b")


@pytest.mark.parametrize("p_tp, d_tp, kv_heads, pairs", [
    (1, 1, 8, True), (2, 2, 8, True), (4, 4, 8, True),  # a = b: rank r pulls from rank r
    (8, 8, 2, True),  # both replicate their 2 KV heads over 8 ranks, the same way
    (2, 1, 8, True), (4, 2, 8, True), (8, 1, 8, True),  # a = k·b: each prefill rank's heads to one decode rank
    (1, 4, 8, False), (2, 4, 8, False),  # a < b: a prefill rank's heads would split (mapped, not moved yet)
    (8, 4, 4, False),  # a > b, but prefill replicates its heads
    (3, 3, 8, False), (4, 3, 8, False),  # 8 heads do not split over 3 ranks
])
def test_tp_sizes_pair_when_the_daemons_can_move_the_heads(p_tp: int, d_tp: int, kv_heads: int, pairs: bool):
    """The pairing rule compares the model and the whole model's layout (the fingerprint), and the
    two TP sizes, never a node's own head count; the refusal names both nodes' TP sizes."""
    r = router_with(node("P", 1, tp_size=p_tp, kv_heads=kv_heads), node("D", 11, tp_size=d_tp, kv_heads=kv_heads))
    assert r.has_pair() is pairs
    if not pairs:
        with pytest.raises(NoNodeAvailable, match=f"TP {d_tp} over {kv_heads} KV heads.*prefill's TP size "
                                                  r"\(or --kv-ranks\) must equal decode's or be a multiple of it"):
            r.pick("m")


@pytest.mark.parametrize("p_tp, kv_ranks, d_tp, pairs", [
    (1, 2, 2, True), (1, 4, 2, True), (2, 4, 4, True), (1, 8, 4, True),  # P's KV ranks: D's TP or a multiple
    (1, 2, 4, False),  # still fewer KV ranks than decode ranks
])
def test_a_prefill_node_with_more_kv_ranks_pairs_with_larger_decode_tp(p_tp, kv_ranks, d_tp, pairs):
    """--kv-ranks cuts each prefill rank's heads in slices, each a KV rank: what pairs is that count."""
    p = node("P", 1, tp_size=p_tp, kv_heads=8, kv_ranks=kv_ranks)
    assert router_with(p, node("D", 11, tp_size=d_tp, kv_heads=8)).has_pair() is pairs


def test_different_total_kv_heads_never_pair_and_a_node_without_tp_is_one_rank():
    assert not router_with(node("P", 1, tp_size=1, kv_heads=8), node("D", 11, tp_size=1, kv_heads=4)).has_pair()
    assert router_with(node("P", 1), node("D", 11, kv_heads=8)).has_pair()  # older P: TP 1
    assert not router_with(node("P", 1), node("D", 11, tp_size=2, kv_heads=8)).has_pair()


def test_registration_refuses_a_tp_size_or_head_count_out_of_bounds():
    from common.registry_client import RegistrationError

    base = {"type": "P", "http_address": "127.0.0.1:1", "zmq_address": "127.0.0.1:2"}
    for bad in ({"tp_size": 0}, {"tp_size": 65}, {"tp_size": "2"}, {"kv_heads": 0}, {"kv_heads": 2.0},
                {"kv_heads": 1 << 17}):
        with pytest.raises(RegistrationError):
            RegistrationMessage.from_dict({**base, **bad})
    assert RegistrationMessage.from_dict({**base, "tp_size": 2, "kv_heads": 8}).tp_size == 2


def test_vllm_format_nodes_pair_only_with_each_other():
    r = router_with(node("P", 1, model=None, fp=None), node("D", 11, model=None, fp=None), node("D", 12))
    for _ in range(4):
        assert r.pick("anything").decode.http_address == "127.0.0.1:11"


def test_model_selects_nodes():
    r = router_with(node("P", 1, model="a"), node("D", 11, model="a"), node("P", 2, model="b"),
                    node("D", 12, model="b"))
    assert r.pick("b").decode.http_address == "127.0.0.1:12"
    assert r.models() == ["a", "b"]
    with pytest.raises(ModelNotFound):
        r.pick("c")


def test_no_nodes_messages():
    with pytest.raises(NoNodeAvailable, match="no prefill node"):
        router_with(node("D", 11)).pick("m")
    with pytest.raises(NoNodeAvailable, match="no decode node"):
        router_with(node("P", 1)).pick("m")
    r = router_with(node("P", 1), node("D", 11))
    with pytest.raises(NoNodeAvailable, match="besides ones that just failed"):
        r.pick("m", frozenset({"127.0.0.1:1"}))


def test_a_node_reported_stalled_gets_no_new_work_until_it_recovers():
    registry = ServiceRegistry(port=0)
    for n in (node("P", 1), node("P", 2, engine_stalled_s=90.0), node("D", 11), node("D", 12)):
        registry.register(n)
    r = Router(registry, "round_robin", stall_limit_s=60.0)
    assert {r.pick("m").prefill.http_address for _ in range(6)} == {"127.0.0.1:1"}
    registry.register(node("P", 2))  # next heartbeat: the engine moved again
    assert {r.pick("m").prefill.http_address for _ in range(6)} == {"127.0.0.1:1", "127.0.0.1:2"}
    registry.register(node("D", 11, engine_stalled_s=61.0))
    registry.register(node("D", 12, engine_stalled_s=120.0))
    with pytest.raises(NoNodeAvailable, match="every compatible decode node is stalled"):
        r.pick("m")


def test_a_node_a_leg_could_not_reach_cools_down_while_others_serve():
    registry = ServiceRegistry(port=0)
    for n in (node("P", 1), node("D", 11), node("D", 12)):
        registry.register(n)
    now = [0.0]
    r = Router(registry, "round_robin", cooldown_s=10.0, clock=lambda: now[0])
    r.unreachable("decode", "127.0.0.1:11")
    assert {r.pick("m").decode.http_address for _ in range(6)} == {"127.0.0.1:12"}
    r.unreachable("decode", "127.0.0.1:12")  # every decode node cooling: still routed, never refused
    assert {r.pick("m").decode.http_address for _ in range(6)} == {"127.0.0.1:11", "127.0.0.1:12"}
    now[0] = 10.5  # the cool-down is over: both take requests again
    assert {r.pick("m").decode.http_address for _ in range(6)} == {"127.0.0.1:11", "127.0.0.1:12"}


def test_nodes_of_different_block_sizes_do_not_pair_and_the_refusal_names_both():
    """A block size is part of the KV layout (the fingerprint): re-blocking would copy every layer."""
    r = router_with(node("P", 1, fp="A", block_size=16), node("D", 11, fp="B", block_size=32))
    with pytest.raises(NoNodeAvailable, match="block size 16.* vs .*block size 32"):
        r.pick("m")
