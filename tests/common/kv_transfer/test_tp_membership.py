"""Keyless pair-slot priority on every KV endpoint of a tensor-parallel prefill node (issue 33).

Rank 0 learns the registered decode nodes from the registry (``Daemon.decode_members``) and
forwards the list to the worker ranks (``KV_MEMBERS``, ``LeaderKVWorker``) when it changes; each
worker's producers (its KV ranks' too, ``SlicedWorker``) then tell members from strangers by
rank 0's rule. Real endpoints, a real ``RankKVServer`` per worker rank, and a leader that serves
each command in this process as a worker rank's loop would.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
from kvt_fixtures import LAYOUT, no_thread_leak  # noqa: F401

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from common.kv_transfer.tp_endpoints import RankKVServer, engine_opener
from common.kv_transfer.tp_ranks import KV_MEMBERS, LeaderKVWorker, RankFollower
from common.kv_transfer.tp_slices import SlicedWorker
from common.kv_transfer.workers import ProducerWorker
from common.node.daemon import Daemon

DECODE = "10.0.0.2:7000"  # a registered decode node of TP 2: the registry lists its ranks' addresses
MEMBERS = frozenset({DECODE, "10.0.0.2:7001"})
STRANGERS = ("", "10.0.0.9:7001", "10.0.0.2:7002")


class Loopback:
    """A ``parallel.Leader`` whose worker ranks are ``RankKVServer``s in this process."""

    def __init__(self, servers: list[RankKVServer]) -> None:
        self.servers, self.size, self.ops, self.replies = servers, len(servers) + 1, [], []
        for server in servers:
            server.worker.group = SimpleNamespace(gather_bytes=self.replies.append)

    def send(self, op, values=(), payload=None):
        self.send_bytes(op, b"")

    def send_bytes(self, op, data):
        self.ops.append(op)
        for server in self.servers:
            server.command(op, data)

    def gather_bytes(self, data):
        replies, self.replies[:] = list(self.replies), []
        return [data, *replies]


def _producer_worker() -> ProducerWorker:
    worker = ProducerWorker()
    worker.bind(KVEndpoint("127.0.0.1:0", LAYOUT), [])
    return worker


def _daemon(key=None) -> Daemon:
    """The daemon's membership rule, with no node behind it: a key or not, and the registry's answer."""
    daemon = object.__new__(Daemon)
    daemon.key, daemon.heartbeater = key, SimpleNamespace(members=None)
    return daemon


@pytest.fixture
def node(no_thread_leak):  # noqa: F811
    """A prefill node of TP 3 (rank 2 with two KV ranks), its daemon's rule on rank 0 as in ``Daemon.start``."""
    rank0, rank1 = _producer_worker(), _producer_worker()
    slices = [_producer_worker(), _producer_worker()]
    servers = [RankKVServer(SimpleNamespace()) for _ in range(2)]
    servers[0].follower = RankFollower("prefill", 1, rank1.transfer, rank1)
    servers[1].follower = RankFollower("prefill", 2, slices[0].transfer, SlicedWorker(slices, LAYOUT.num_kv_heads))
    daemon, leader = _daemon(), Loopback(servers)
    rank0.transfer.producer.is_member = daemon.member_decode
    worker = LeaderKVWorker(rank0, leader, "prefill", members=daemon.decode_members)
    producers = [w.transfer.producer for w in (rank0, rank1, *slices)]
    yield SimpleNamespace(daemon=daemon, leader=leader, worker=worker, producers=producers)
    for w in (rank0, rank1, *slices):
        w.transfer.close()


def _members_sent(leader: Loopback) -> int:
    return leader.ops.count(KV_MEMBERS)


def test_before_the_registry_answers_every_consumer_is_a_member(node):
    for _ in range(3):
        node.worker.get_finished()
    assert _members_sent(node.leader) == 0
    assert all(p.is_member(c) for p in node.producers for c in (DECODE, *STRANGERS))


def test_the_member_list_reaches_every_rank_and_kv_rank(node):
    """Rank 1 and both KV ranks of rank 2 count the registered decode ranks only, as rank 0 does."""
    node.daemon.heartbeater.members = MEMBERS
    node.worker.get_finished()
    for p in node.producers:
        assert p.is_member(DECODE) and p.is_member("10.0.0.2:7001")
        assert not any(p.is_member(c) for c in STRANGERS)


def test_the_list_is_sent_once_per_change_not_every_step(node):
    """Each heartbeat's answer is a new set: an equal one sends nothing; a change is sent at the next poll."""
    hb = node.daemon.heartbeater
    for _ in range(5):
        hb.members = frozenset(MEMBERS)
        node.worker.get_finished()
    assert _members_sent(node.leader) == 1
    hb.members = MEMBERS | {"10.0.0.9:7001"}  # another decode node registered
    assert node.producers[1].is_member(DECODE) and not node.producers[1].is_member("10.0.0.9:7001")
    node.worker.get_finished()
    node.worker.get_finished()
    assert _members_sent(node.leader) == 2 and all(p.is_member("10.0.0.9:7001") for p in node.producers)
    hb.members = frozenset()  # every decode node left: nobody is a member
    node.worker.get_finished()
    assert _members_sent(node.leader) == 3 and not any(p.is_member(DECODE) for p in node.producers)


def test_with_a_cluster_key_every_consumer_is_a_member(node):
    """A sealed handshake is a member's: the registry's list does not matter and nothing is sent."""
    node.daemon.key = object()
    node.daemon.heartbeater.members = MEMBERS
    for _ in range(3):
        node.worker.get_finished()
    assert _members_sent(node.leader) == 0
    assert all(p.is_member(c) for p in node.producers for c in (DECODE, *STRANGERS))


def test_a_sliced_rank0_asks_whatever_its_first_endpoint_is_told():
    """Rank 0's KV ranks are built before the daemon sets the first endpoint's is_member: they follow it."""
    workers = [ProducerWorker() for _ in range(3)]
    for w in workers:
        w.bind(SimpleNamespace(producer=SimpleNamespace(is_member=None)), [])
    SlicedWorker(workers, num_heads=6)
    workers[0].transfer.producer.is_member = lambda consumer: consumer == DECODE
    assert [w.transfer.producer.is_member(DECODE) for w in workers] == [True] * 3
    assert [w.transfer.producer.is_member("10.0.0.9:7000") for w in workers] == [False] * 3


def test_a_route_consumer_names_its_rank_address_not_its_own_port(no_thread_leak):  # noqa: F811
    """A decode rank's route consumer listens at a port nobody dials: its handshakes name the rank's
    address, the one the registry lists, so a keyless prefill node does not take it for a stranger."""
    spec = {"role": "decode", "host": "127.0.0.1", "advertise_host": None, "transport": "tcp", "key_file": None,
            "config": dataclasses.asdict(TransferConfig()), "vocab_size": 100}
    route = engine_opener(spec, "cpu", None, "127.0.0.1:7001")(LAYOUT)
    try:
        assert route.consumer.address == "127.0.0.1:7001" != f"127.0.0.1:{route.address.rpartition(':')[2]}"
    finally:
        route.close()
