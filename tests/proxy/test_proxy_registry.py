"""The registry over a real ROUTER: both message formats, eviction by the sweep, static nodes."""

from __future__ import annotations

import msgpack
import pytest
import zmq

from common.registry_client import RegistrationMessage, decode_members, encode
from helpers.waiting import wait_for
from helpers.zmq_peer import raw_dealer
from proxy.registry import ServiceRegistry


@pytest.fixture
def registry():
    reg = ServiceRegistry(port=0, heartbeat_timeout_s=0.4, sweep_interval_s=0.05)
    reg.start()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def dealer(registry):
    with raw_dealer(registry.address) as sock:
        yield sock


def test_vllm_format_registers(registry, dealer):
    dealer.send(msgpack.packb({"type": "P", "http_address": "127.0.0.1:8100", "zmq_address": "127.0.0.1:14579"}))
    assert wait_for(lambda: registry.counts()["P"] == 1)
    node = registry.nodes("P")[0].info
    assert (node.http_address, node.zmq_address, node.model, node.kv_fingerprint) == (
        "127.0.0.1:8100", "127.0.0.1:14579", None, None)


def test_rich_heartbeat_registers_and_refreshes(registry, dealer):
    msg = RegistrationMessage("D", "127.0.0.1:8200", "127.0.0.1:14580", model="tiny", kv_fingerprint="abc",
                              version=1, node_id="d-1", num_running=3, num_waiting=2, num_free_blocks=10)
    dealer.send(encode(msg))
    assert wait_for(lambda: registry.counts()["D"] == 1)
    assert registry.nodes("D")[0].info == msg
    dealer.send(encode(RegistrationMessage("D", "127.0.0.1:8200", "127.0.0.1:14580", model="tiny",
                                           kv_fingerprint="abc", num_running=0)))
    assert wait_for(lambda: registry.nodes("D")[0].info.num_running == 0)
    assert registry.counts() == {"P": 0, "D": 1}  # same node, refreshed, not duplicated


def test_silent_node_is_evicted_by_the_sweep(registry, dealer):
    dealer.send(msgpack.packb({"type": "D", "http_address": "127.0.0.1:1", "zmq_address": "127.0.0.1:2"}))
    assert wait_for(lambda: registry.counts()["D"] == 1)
    # Nobody else sends anything: only the periodic sweep can evict it.
    assert wait_for(lambda: registry.counts()["D"] == 0, timeout=3)


def test_beating_node_stays(registry, dealer):
    beat = msgpack.packb({"type": "P", "http_address": "127.0.0.1:1", "zmq_address": "127.0.0.1:2"})
    for _ in range(8):
        dealer.send(beat)
        wait_for(lambda: False, timeout=0.1)
        assert registry.counts()["P"] == 1


def test_bad_messages_are_ignored(registry, dealer):
    dealer.send(b"\xc1 not msgpack")
    dealer.send(msgpack.packb({"type": "X", "http_address": "127.0.0.1:1", "zmq_address": "127.0.0.1:2"}))
    dealer.send(msgpack.packb([1, 2]))
    dealer.send(msgpack.packb({"type": "P", "http_address": "127.0.0.1:1", "zmq_address": "127.0.0.1:2"}))
    assert wait_for(lambda: registry.counts()["P"] == 1)
    assert registry.counts()["D"] == 0


def test_static_nodes_are_never_evicted():
    static = [RegistrationMessage("P", "h:1", "h:2"), RegistrationMessage("D", "h:3", "h:4")]
    reg = ServiceRegistry(port=0, heartbeat_timeout_s=0.1, sweep_interval_s=0.02, static_nodes=static)
    reg.start()
    try:
        wait_for(lambda: False, timeout=0.4)
        assert reg.counts() == {"P": 1, "D": 1}
    finally:
        reg.stop()


def test_taken_port_raises():
    first = ServiceRegistry(port=0)
    first.start()
    try:
        with pytest.raises(zmq.ZMQError):
            ServiceRegistry(port=first.port).start()
    finally:
        first.stop()


def test_slow_beating_node_gets_three_of_its_intervals(registry, dealer):
    dealer.send(encode(RegistrationMessage("P", "127.0.0.1:1", "127.0.0.1:2", heartbeat_interval_s=0.3)))
    assert wait_for(lambda: registry.counts()["P"] == 1)
    wait_for(lambda: False, timeout=0.6)  # past the registry's 0.4 s, within 3 x 0.3 s
    assert registry.counts()["P"] == 1
    assert wait_for(lambda: registry.counts()["P"] == 0, timeout=2)


def test_a_joining_prefill_node_is_pushed_to_decode_nodes_at_once(registry, dealer):
    """A decode node pulls only from the prefill nodes the registry named; one that joins later is
    named to it at once, not in the answer to its next heartbeat (this one never beats again)."""
    with raw_dealer(registry.address) as decode:
        decode.send(encode(RegistrationMessage("D", "127.0.0.1:8200", "127.0.0.1:14580", model="tiny",
                                               kv_fingerprint="abc", heartbeat_interval_s=30.0)))
        assert decode.poll(10_000) and decode_members(decode.recv()) == frozenset()  # no prefill node yet
        dealer.send(encode(RegistrationMessage("P", "127.0.0.1:8101", "127.0.0.1:14581", model="other",
                                               kv_fingerprint="abc")))
        dealer.send(encode(RegistrationMessage("P", "127.0.0.1:8100", "127.0.0.1:14579", model="tiny",
                                               kv_fingerprint="abc")))
        # one push per joining prefill node; another model's node is never named to it
        assert decode.poll(10_000) and decode_members(decode.recv()) == frozenset()
        assert decode.poll(10_000) and decode_members(decode.recv()) == frozenset({"127.0.0.1:14579"})
