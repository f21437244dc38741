"""Heartbeats to every proxy (common/proxy_heartbeats.py), against real registries (the proxy's
``ServiceRegistry``, in this process, over real ZMQ): every address ``--proxy`` stands for hears from
the node; a DNS name is resolved again (an address that appears is served, one that is gone gets a
goodbye, a failed lookup keeps the last addresses); the member list is the union of the answers of
the registries that answered recently."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest
from helpers.ports import free_port
from helpers.waiting import wait_until

from common.cluster_auth import ClusterKey
from common.proxy_addresses import ProxyEntry
from common.proxy_heartbeats import FRESH_BEATS, ProxyHeartbeats
from common.registry_client import RegistrationMessage
from proxy.registry import ServiceRegistry

KEY = ClusterKey(b"k" * 32)  # sealed: a registry on 127.0.0.2 takes a node that says 127.0.0.1
INTERVAL_S = 0.2
NODE = {"type": "D", "http_address": "127.0.0.1:8200", "zmq_address": "127.0.0.1:14580", "model": "m",
        "kv_fingerprint": "fp"}


def _prefill(n: int) -> RegistrationMessage:
    return RegistrationMessage(type="P", http_address=f"10.0.0.{n}:8100", zmq_address=f"10.0.0.{n}:14579",
                               model="m", kv_fingerprint="fp")


@pytest.fixture
def registries() -> Iterator[list[ServiceRegistry]]:
    """Three registries on one port of 127.0.0.1, .2 and .3 (what a name standing for three proxy
    pods gives), each with a static prefill node of its own (10.0.0.1, .2, .3)."""
    port = free_port()
    regs = [ServiceRegistry(f"127.0.0.{i}", port, static_nodes=[_prefill(i)], key=KEY, sweep_interval_s=0.1)
            for i in (1, 2, 3)]
    for reg in regs:
        reg.start()
    yield regs
    for reg in regs:
        reg.stop()


def _heartbeats(entries: tuple[ProxyEntry, ...], dns=socket.getaddrinfo) -> ProxyHeartbeats:
    return ProxyHeartbeats(entries, lambda: dict(NODE), INTERVAL_S, resolve_interval_s=0.1, key=KEY,
                           getaddrinfo=dns)


def _registered(reg: ServiceRegistry) -> bool:
    return reg.get("D", NODE["http_address"]) is not None


class FakeDNS:
    """A getaddrinfo whose answer for the one name the test uses can change (or fail)."""

    def __init__(self, hosts: list[str]) -> None:
        self.hosts: list[str] | None = hosts

    def __call__(self, host: str, port: int, family: int, kind: int) -> list:
        if self.hosts is None:
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        if family != socket.AF_INET or not self.hosts:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        return [(family, kind, 6, "", (h, port)) for h in self.hosts]


def test_every_listed_proxy_hears_from_the_node_and_answers_count_together(registries) -> None:
    a, b, _ = registries
    beats = _heartbeats((ProxyEntry("127.0.0.1", a.port), ProxyEntry("127.0.0.2", b.port)))
    beats.start()
    try:
        assert beats.addresses == [f"127.0.0.1:{a.port}", f"127.0.0.2:{b.port}"]
        wait_until(lambda: _registered(a) and _registered(b), "the node registered with both proxies")
        wait_until(lambda: beats.members == {"10.0.0.1:14579", "10.0.0.2:14579"},
                   "the member list is the union of both registries' answers")
        assert beats.answering == beats.addresses
        a.stop()  # killed: its last answer stops counting once it is FRESH_BEATS intervals old
        wait_until(lambda: beats.members == {"10.0.0.2:14579"}, "the dead registry's answer dropped",
                   timeout=10 * FRESH_BEATS * INTERVAL_S)
        a.start()  # back on its port: served again within a heartbeat of listening
        wait_until(lambda: _registered(a), "the node registered again with the restarted proxy")
        wait_until(lambda: beats.members == {"10.0.0.1:14579", "10.0.0.2:14579"}, "its answer counts again")
    finally:
        beats.stop()
    # the goodbyes are sent before stop returns; each registry reads its own on its thread
    wait_until(lambda: not _registered(a) and not _registered(b), "a graceful stop says goodbye to every proxy")


def test_with_every_registry_gone_the_last_answers_stand(registries) -> None:
    a, b, _ = registries
    beats = _heartbeats((ProxyEntry("127.0.0.1", a.port), ProxyEntry("127.0.0.2", b.port)))
    beats.start()
    try:
        wait_until(lambda: beats.members == {"10.0.0.1:14579", "10.0.0.2:14579"}, "both answers")
        a.stop()
        b.stop()
        wait_until(lambda: beats.answering == [], "both answers past the freshness window")
        # the best known list is every last answer, not None ("anyone goes")
        assert beats.members == {"10.0.0.1:14579", "10.0.0.2:14579"}
    finally:
        beats.stop()


def test_a_name_is_resolved_again_and_its_addresses_follow(registries) -> None:
    a, b, c = registries
    dns = FakeDNS(["127.0.0.1"])
    beats = _heartbeats((ProxyEntry("proxies.test", a.port),), dns)
    beats.start()
    try:
        wait_until(lambda: _registered(a), "the one address the name had hears from the node")
        dns.hosts = ["127.0.0.1", "127.0.0.2", "127.0.0.3"]  # two proxy pods more
        wait_until(lambda: _registered(b) and _registered(c), "the new addresses served at the next resolution")
        dns.hosts = None  # DNS down: the addresses it had are kept
        wait_until(lambda: beats.members == {"10.0.0.1:14579", "10.0.0.2:14579", "10.0.0.3:14579"}, "three answers")
        beats.refresh()
        assert len(beats.addresses) == 3 and _registered(a)
        dns.hosts = ["127.0.0.2", "127.0.0.3"]  # a pod gone: goodbye, and no more beats
        wait_until(lambda: not _registered(a), "the proxy the name no longer names was said goodbye to")
        assert beats.addresses == [f"127.0.0.2:{a.port}", f"127.0.0.3:{a.port}"]
        wait_until(lambda: beats.members == {"10.0.0.2:14579", "10.0.0.3:14579"}, "its answer no longer counts")
    finally:
        beats.stop()


def test_a_name_that_does_not_resolve_yet_is_tried_until_it_does(registries) -> None:
    a = registries[0]
    dns = FakeDNS([])  # no such name yet (a compose service whose proxies are not up)
    beats = _heartbeats((ProxyEntry("proxies.test", a.port),), dns)
    beats.start()
    try:
        assert beats.addresses == [] and beats.members is None and beats.beats_sent == 0
        dns.hosts = ["127.0.0.1"]
        # the heartbeat thread counts a beat just after handing it over: the registry may see it first
        wait_until(lambda: _registered(a) and beats.beats_sent > 0, "the node registered once the name resolved")
    finally:
        beats.stop()


def test_the_peers_are_the_union_of_the_registries_answers() -> None:
    """A node running --kv-peer-fetch is named its peers by each registry; it may fetch from any of them."""
    peers = [RegistrationMessage(type="P", http_address=f"10.0.0.{n}:8100", zmq_address=f"10.0.0.{n}:14579",
                                 model="m", kv_fingerprint="fp", kv_peer_fetch=True) for n in (1, 2)]
    regs = [ServiceRegistry("127.0.0.1", 0, static_nodes=[p], key=KEY, sweep_interval_s=0.1) for p in peers]
    for reg in regs:
        reg.start()
    beats = ProxyHeartbeats(tuple(ProxyEntry("127.0.0.1", reg.port) for reg in regs),
                            lambda: {**NODE, "kv_peer_fetch": True}, INTERVAL_S, key=KEY)
    assert beats.peers == frozenset()
    beats.start()
    try:
        wait_until(lambda: beats.peers == {"10.0.0.1:14579", "10.0.0.2:14579"}, "both registries' peers")
    finally:
        beats.stop()
        for reg in regs:
            reg.stop()
