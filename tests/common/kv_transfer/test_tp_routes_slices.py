"""tp_routes (a decode rank's loads from a prefill node of a larger TP size), tp_slices (a prefill
rank's KV ranks), the registry's member TP sizes and --kv-ranks: with fake KV endpoints."""

from __future__ import annotations

from types import SimpleNamespace

import msgpack
import pytest
import torch

from common.config import NodeConfig
from common.engine.kv_connector import FinishedTransfers, HandoverSpec, KVConnectorMetadata, LoadSpec, SaveSpec
from common.kv_layout import KVLayout
from common.kv_transfer.consumer_table import ConsumerState as C
from common.kv_transfer.consumer_table import ConsumerTable, Transfer
from common.kv_transfer.producer_table import ProducerState as S
from common.kv_transfer.producer_table import ProducerTable
from common.kv_transfer.tp_routes import RankRoutes
from common.kv_transfer.tp_slices import SlicedWorker, slice_caches, slice_heads, slice_layout
from common.registry_client import (RegistrationError, RegistrationMessage, decode_member_tp_sizes, decode_members,
                                    encode_members)

HD, BS, BLOCKS = 4, 2, 3


def _layout(heads: int) -> KVLayout:
    return KVLayout(num_layers=2, num_kv_heads=heads, head_dim=HD, block_size=BS, dtype="float32")


def _caches(heads: int, layers: int = 2) -> list[torch.Tensor]:
    return [torch.zeros(2, BLOCKS, BS, heads, HD) for _ in range(layers)]


# ---- tp_slices: the helpers -----------------------------------------------------------------
def test_slices_partition_the_heads():
    """k slices of a rank's heads are equal, disjoint and cover every head in order."""
    for heads, k in ((8, 4), (8, 2), (4, 4), (6, 3), (2, 1)):
        covered = [h for j in range(k) for h in range(heads)[slice_heads(heads, k, j)]]
        assert covered == list(range(heads))
        assert {len(range(heads)[slice_heads(heads, k, j)]) for j in range(k)} == {heads // k}
        assert slice_layout(_layout(heads), k) == _layout(heads // k)


def test_slice_caches_are_views_of_exactly_those_heads():
    """Writing through slice_caches(...)[layer] changes exactly those heads of the real cache."""
    caches = _caches(4)
    views = slice_caches(caches, slice_heads(4, 2, 1))
    assert [v.shape for v in views] == [torch.Size([2, BLOCKS, BS, 2, HD])] * 2
    views[1].fill_(7.0)
    assert torch.all(caches[1][:, :, :, 2:4] == 7.0)
    assert torch.all(caches[1][:, :, :, 0:2] == 0.0) and torch.all(caches[0] == 0.0)


# ---- tp_routes: a fake KV endpoint a real ConsumerWorker is bound to --------------------
class FakeConsumer:
    """KVConsumer's calls on a real ConsumerTable: ``request`` queues the load on a pretend link."""

    def __init__(self) -> None:
        self.table = ConsumerTable()
        self.requests: list[tuple] = []
        self.aborts: list[str] = []
        self.released: list[tuple[str, str]] = []
        self.transfers: dict[str, Transfer] = {}

    def request(self, rid, addr, block_ids, num_tokens, kv_caches, first_block=0):
        self.requests.append((rid, addr, tuple(block_ids), num_tokens, kv_caches, first_block))
        self.transfers[rid] = self.table.start(rid, block_ids, num_tokens, kv_caches, first_block, link=object())

    def abort(self, rid):
        self.aborts.append(rid)
        self.table.stop(rid)

    def release_remote(self, rid, addr):
        self.released.append((rid, addr))

    def known_peer(self, addr):
        return not addr.startswith("unknown")

    def poll_finished(self):
        return self.table.poll_finished()

    def take_landed(self, rids):
        return self.table.take_landed(rids)

    def poll_aborted(self):
        return self.table.poll_aborted()

    # what a link thread would do
    def land(self, rid, token, **extras):
        self.table.pull_sent(self.transfers[rid])
        assert self.table.finish(self.transfers[rid], C.LANDED, first_token=token, **extras)

    def fail(self, rid, error):
        assert self.table.finish(self.transfers[rid], C.FAILED, error=error)


def _routes(rank=0, tp=1, heads=2):
    """RankRoutes over fake engines; returns it and the list of (layout, engine) opened."""
    opened = []

    def open_engine(layout, port=0):
        engine = SimpleNamespace(layout=layout, consumer=FakeConsumer(), close=lambda: None)
        opened.append(engine)
        return engine

    local = heads // tp
    return RankRoutes(rank, tp, heads, _layout(local), _caches(local), open_engine), opened


def _load(rid="r1", src_tp=2, addr="10.0.0.1:5000"):
    return LoadSpec(rid, addr, (4, 5, 6), 1, 9, src_tp=src_tp)


def test_routed_only_for_another_known_tp_size():
    """A load is routed unless its src_tp is 0 (unknown) or this rank's TP size."""
    routes, _ = _routes(rank=1, tp=2, heads=8)
    assert [routes.routed(_load(src_tp=n)) for n in (0, 2, 1, 4, 8)] == [False, False, True, True, True]


def test_tp1_load_from_tp2_opens_one_consumer_per_head():
    """Decode TP 1, 2 heads, src_tp 2: consumers for heads (0,1) and (1,2) ask prefill port+0, port+1."""
    routes, opened = _routes()
    routes.load(_load())
    assert sorted(routes.workers) == [(0, 1), (1, 2)]
    assert [e.layout for e in opened] == [_layout(1), _layout(1)]
    asked = [e.consumer.requests for e in opened]
    assert [[(r[0], r[1], r[2], r[3], r[5]) for r in a] for a in asked] == [
        [("r1", "10.0.0.1:5000", (4, 5, 6), 9, 1)], [("r1", "10.0.0.1:5001", (4, 5, 6), 9, 1)]]
    for j, a in enumerate(asked):  # each lands in a view of its head of the rank's cache
        view = a[0][4][0]
        assert view.shape == (2, BLOCKS, BS, 1, HD)
        assert view.data_ptr() == routes.kv_caches[0].data_ptr() + j * HD * view.element_size()
    routes.load(_load("r2"))
    assert len(opened) == 2  # one consumer per head slice, once


def test_tp2_rank1_load_from_tp4_routes_from_prefill_ranks_2_and_3():
    """Decode TP 2 rank 1, 8 heads, src_tp 4: routes from prefill ranks 2 and 3, 2 heads each."""
    routes, opened = _routes(rank=1, tp=2, heads=8)
    routes.load(_load(src_tp=4))
    assert sorted(routes.workers) == [(0, 2), (2, 4)]
    assert [e.layout.num_kv_heads for e in opened] == [2, 2]
    assert [e.consumer.requests[0][1] for e in opened] == ["10.0.0.1:5002", "10.0.0.1:5003"]
    assert [src for src, _ in routes.loads["r1"]] == [2, 3]


def test_done_only_when_every_route_landed_with_the_first_routes_token():
    """The load is done once both routes landed; the first token and extras are the first route's."""
    routes, opened = _routes()
    routes.load(_load())
    e0, e1 = opened
    e1.consumer.land("r1", 99, first_logprobs={99: -2.0}, cached_tokens=4)
    assert routes.get_finished() == FinishedTransfers()
    e0.consumer.land("r1", 7, first_logprobs={7: -0.5}, cached_tokens=2)
    out = routes.get_finished()
    assert (out.done_recving, out.first_logprobs, out.cached_tokens) == ({"r1": 7}, {"r1": {7: -0.5}}, {"r1": 2})
    assert not out.failed_recving and not out.stopped and routes.loads == {}
    assert routes.get_finished() == FinishedTransfers()


def test_a_route_failure_aborts_the_other_and_fails_once():
    """Route 1 fails: route 0 (still receiving) is aborted; the load fails once, naming prefill rank 1."""
    routes, opened = _routes()
    routes.load(_load())
    e0, e1 = opened
    e1.consumer.fail("r1", "connection reset")
    assert routes.get_finished() == FinishedTransfers()  # route 0 may still write into the blocks
    assert e0.consumer.aborts == ["r1"] and e1.consumer.aborts == []
    assert e0.consumer.table.state("r1") is C.ABORTING
    e0.consumer.table.abort_stopped("r1")
    out = routes.get_finished()
    assert out.failed_recving == {"r1": "the route from prefill rank 1: connection reset"}
    assert not out.done_recving and not out.stopped
    assert routes.get_finished() == FinishedTransfers()


def test_a_scheduler_abort_is_stopped_once_every_route_stopped():
    """An abort in the metadata stops both routes; "stopped" comes once neither can write."""
    routes, opened = _routes()
    routes.load(_load())
    e0, e1 = opened
    own, routed = routes.split(KVConnectorMetadata(aborts=("r1", "other")), e0.consumer, lambda a: 0)
    assert own.aborts == ("other",) and routed == []
    assert e0.consumer.aborts == ["r1"] and e1.consumer.aborts == ["r1"]
    e0.consumer.table.abort_stopped("r1")
    assert routes.get_finished() == FinishedTransfers()
    e1.consumer.table.abort_stopped("r1")
    assert routes.get_finished() == FinishedTransfers(stopped={"r1"})
    assert routes.get_finished() == FinishedTransfers()


def test_a_split_of_a_prefill_ranks_heads_is_refused_without_a_consumer():
    """Decode TP 2 rank 1 from src_tp 1 (part of prefill rank 0's heads) fails "not built", opens nothing."""
    routes, opened = _routes(rank=1, tp=2, heads=2)
    routes.load(_load(src_tp=1))
    assert opened == [] and routes.loads == {}
    out = routes.get_finished()
    assert list(out.failed_recving) == ["r1"] and "not built" in out.failed_recving["r1"]
    assert routes.get_finished() == FinishedTransfers()


def test_rank0_split_of_a_prefill_ranks_heads_is_refused_too():
    """Decode TP 2 rank 0 from src_tp 1 needs half of prefill rank 0's heads: refused as on rank 1."""
    routes, opened = _routes(rank=0, tp=2, heads=2)
    routes.load(_load(src_tp=1))
    assert opened == []
    assert "not built" in routes.get_finished().failed_recving.get("r1", "")


def test_split_takes_routed_loads_and_sends_their_releases():
    """split() keeps own loads and releases; routed loads and releases go through the routes."""
    routes, opened = _routes()
    own_consumer = FakeConsumer()
    routed_load, local, unknown = _load("a"), _load("b", src_tp=1), _load("c", addr="unknown:1")
    unknown_tp = _load("d", src_tp=0)
    meta = KVConnectorMetadata(
        loads=(routed_load, local, unknown, unknown_tp), saves=(SaveSpec("s", 0, "x:1", (1,), 2),),
        releases=(("R1", "p:5000", 2), ("R2", "q:6000"), ("R3", "p:5000"), ("R4", "q:6000", 1)))
    own, routed = routes.split(meta, own_consumer, lambda addr: 2 if addr.startswith("p:") else 0)
    assert routed == [routed_load]
    assert own.loads == (local, unknown, unknown_tp) and own.saves == meta.saves
    assert own.releases == (("R2", "q:6000"), ("R4", "q:6000"))
    assert own_consumer.released == [("R1", "p:5000"), ("R1", "p:5001"), ("R3", "p:5000"), ("R3", "p:5001")]
    assert [e.consumer.requests[0][:2] for e in opened] == [("a", "10.0.0.1:5000"), ("a", "10.0.0.1:5001")]


# ---- tp_slices: SlicedWorker over fake producer workers -------------------------------------
class FakeProducerWorker:
    def __init__(self) -> None:
        self.transfer = SimpleNamespace(producer=SimpleNamespace(table=ProducerTable()), close=lambda: None)
        self.issued: list[KVConnectorMetadata] = []
        self.saved: list[tuple] = []
        self.freeable: list[set[str]] = []  # canned: one set per get_finished

    @property
    def producer(self):
        return self.transfer.producer

    def issue(self, meta):
        self.issued.append(meta)

    def save_kv_layer(self, layer_idx, kv_layer, meta):
        self.saved.append((layer_idx, kv_layer, meta))

    def get_finished(self):
        return FinishedTransfers(freeable=self.freeable.pop(0) if self.freeable else set())


def _handover(rid):
    return HandoverSpec(rid, "d:1", 5, None, (1, 2), 4)


def test_sliced_issue_hands_over_on_all_but_the_first_table():
    """issue(): every worker gets the metadata; the hand-over is recorded on workers 1.. only."""
    workers = [FakeProducerWorker() for _ in range(3)]
    sliced = SlicedWorker(workers, num_heads=6)
    meta = KVConnectorMetadata(handovers=(_handover("h1"),))
    sliced.issue(meta)
    assert all(w.issued == [meta] for w in workers)
    assert [w.transfer.producer.table.state("h1") for w in workers] == [None, S.HANDED_OVER, S.HANDED_OVER]
    assert sliced.transfer is workers[0].transfer


def test_sliced_save_gives_each_worker_its_slice_view():
    """save_kv_layer: worker j gets a view of heads slice j of the given layer."""
    workers = [FakeProducerWorker() for _ in range(2)]
    sliced = SlicedWorker(workers, num_heads=4)
    layer, meta = torch.zeros(2, BLOCKS, BS, 4, HD), KVConnectorMetadata(saves=(SaveSpec("s", 0, "d:1", (1,), 2),))
    sliced.save_kv_layer(3, layer, meta)
    for j, w in enumerate(workers):
        (idx, view, got), = w.saved
        assert (idx, got, view.shape) == (3, meta, (2, BLOCKS, BS, 2, HD))
        assert view.data_ptr() == layer.data_ptr() + 2 * j * HD * layer.element_size()
    workers[1].saved[0][1].fill_(1.0)
    assert layer[:, :, :, 2:].eq(1.0).all() and layer[:, :, :, :2].eq(0.0).all()


def test_sliced_freeable_once_every_kv_rank_released():
    """A hand-over is freeable once, after the last KV rank released it; unknown ids: only the first's pass."""
    workers = [FakeProducerWorker() for _ in range(2)]
    sliced = SlicedWorker(workers, num_heads=2)
    sliced.issue(KVConnectorMetadata(handovers=(_handover("h1"),)))
    workers[0].freeable = [{"h1", "x0"}, set(), set()]
    workers[1].freeable = [{"y1"}, {"h1"}, {"h1"}]
    assert sliced.get_finished().freeable == {"x0"}
    assert workers[1].transfer.producer.table.state("h1") is S.HANDED_OVER
    assert sliced.get_finished().freeable == {"h1"}
    assert workers[1].transfer.producer.table.state("h1") is None  # forgotten on worker 1's table
    assert sliced.get_finished().freeable == set()


# ---- the registry's member list and registration -------------------------------------------
def test_members_carry_tp_sizes():
    """encode_members' tp_sizes come back for the members; decode_members gives the addresses."""
    frame = encode_members(["a:1", "b:2"], {"a:1": 4})
    members = decode_members(frame)
    assert members == frozenset({"a:1", "b:2"})
    assert decode_member_tp_sizes(frame, members) == {"a:1": 4}


def test_member_tp_sizes_drop_bad_entries():
    """Non-members, bools, 0, 65 and non-ints are dropped; a frame without tp_sizes gives {}."""
    sizes = {"a:1": 2, "b:2": True, "c:3": 0, "d:4": 65, "e:5": "2", "f:6": 2.0, "z:9": 3, "g:7": 64}
    addrs = ["a:1", "b:2", "c:3", "d:4", "e:5", "f:6", "g:7"]
    frame = msgpack.packb({"members": addrs, "tp_sizes": sizes}, use_bin_type=True)
    assert decode_member_tp_sizes(frame, decode_members(frame)) == {"a:1": 2, "g:7": 64}
    old = msgpack.packb({"members": ["a:1"]}, use_bin_type=True)
    assert decode_member_tp_sizes(old, decode_members(old)) == {}


def test_registration_kv_ranks_bounds():
    """kv_ranks 1..64 are accepted; 0, 65, "2" and 2.0 are refused."""
    base = {"type": "P", "http_address": "h:1", "zmq_address": "h:2"}
    for n in (1, 8, 64):
        assert RegistrationMessage.from_dict({**base, "kv_ranks": n}).kv_ranks == n
    for bad in (0, 65, "2", 2.0):
        with pytest.raises(RegistrationError):
            RegistrationMessage.from_dict({**base, "kv_ranks": bad})


# ---- --kv-ranks ---------------------------------------------------------------------------------
def test_kv_rank_count_follows_kv_ranks_on_prefill_only():
    """Prefill kv_ranks 4 at TP 2 gives 4 KV ranks; a decode node has one per TP rank."""
    assert NodeConfig(role="prefill", kv_ranks=4, tensor_parallel_size=2).kv_rank_count == 4
    assert NodeConfig(role="prefill", tensor_parallel_size=2).kv_rank_count == 2
    assert NodeConfig(role="decode", tensor_parallel_size=2).kv_rank_count == 2


def test_kv_ranks_must_be_a_multiple_of_the_tp_size():
    """kv_ranks 3 at TP 2 is refused with a message naming both numbers."""
    with pytest.raises(ValueError, match=r"--kv-ranks 3 .*--tensor-parallel-size 2"):
        NodeConfig(role="prefill", kv_ranks=3, tensor_parallel_size=2)
