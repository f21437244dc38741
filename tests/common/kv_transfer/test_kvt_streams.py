"""The GPU paths' stream/event protocol, checked on CPU through the StreamOps seam.

A recording fake stands in for CUDA streams; the copies themselves run on CPU tensors, so
each test checks both the order of record/wait/synchronize calls and the bytes.
"""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch

import common.kv_transfer.producer as producer_mod
import common.kv_transfer.sender as sender_mod
from common.kv_transfer.config import TransferConfig, TransferStats
from common.kv_transfer.cuda_ipc import IpcPair
from common.kv_transfer.messages import Handshake, Pull
from common.kv_transfer.paged import ByteBudget
from common.kv_transfer.producer import KVProducer
from common.kv_transfer.producer_table import ProducerRequest, ProducerState, ProducerTable
from common.kv_transfer.sender import STOP, PairSender, SendJob
from common.kv_transfer.transport import Endpoint
from kvt_fixtures import FAST, LAYOUT
from kvt_peers import make_kv, same_bytes
from helpers.waiting import wait_for
from kvt_streams import FakeControl, FakeSendPair, RecordingStreams, index_of

ENGINE = f"current:cpu@{threading.current_thread().name}"  # the test thread plays the engine



def stop(sender: PairSender) -> None:
    """End the sender after its queued jobs, and wait until it closed."""
    sender.put(STOP)
    assert wait_for(lambda: sender.closed, 5)

def _entries(log: list, kind: str) -> list[tuple]:
    return [e for e in log if e[0] == kind]


@pytest.fixture
def gloo_producer(monkeypatch):
    """A producer with one pulled request "r" on a gloo/nccl-path pair whose sends are logged."""
    log: list = []
    streams, control = RecordingStreams(log), FakeControl(log)
    pair = FakeSendPair(log, control)
    monkeypatch.setattr(sender_mod, "open_pair", lambda *a, **k: pair)
    gather = producer_mod.gather_blocks

    def logged_gather(*args, **kwargs):
        out = gather(*args, **kwargs)
        log.append(("gather",))
        return out

    monkeypatch.setattr(producer_mod, "gather_blocks", logged_gather)
    producer = KVProducer(LAYOUT, TransferConfig(**FAST), TransferStats(), "127.0.0.1", "cpu", "gloo",
                          streams=streams)
    producer.control = control
    producer.handle(b"d", Handshake(id=1, pair_id="p", layout=LAYOUT.to_dict(), backend="gloo",
                                    endpoint=Endpoint.local("cpu").to_dict()))
    producer.handle(b"d", Pull(id=2, request_id="r", pair_id="p", num_blocks=2, num_tokens=8, block_ids=[0, 1]))
    yield producer, log, control, pair
    producer.close()


def test_send_waits_on_the_event_recorded_after_the_gather(gloo_producer):
    """save_layer gathers on the engine's stream and records an event after it; the stream of the
    thread that sends (the endpoint's I/O thread) waits on that event before the send (NCCL
    orders its stream after the caller's)."""
    producer, log, control, pair = gloo_producer
    kv = make_kv(LAYOUT, 8, 1)
    producer.save_layer("r", 0, kv[0], [5, 2])  # scattered: gathered into a staging tensor
    assert control.wait_for(lambda: ("send", 1) in log)
    (record,) = _entries(log, "record")
    assert record[1] == ENGINE
    event = record[2]
    (wait,) = [e for e in _entries(log, "wait") if e[2] == event]
    assert wait[1] == "current:cpu@fake-io"  # the I/O thread's stream
    assert index_of(log, ("gather",)) < log.index(record) < log.index(wait) < index_of(log, ("send", 1))
    assert same_bytes(pair.sent[0][0][0], kv[0][:, [5, 2]])


def test_sends_from_the_blocks_wait_on_the_prompts_last_write(gloo_producer):
    """Layers sent after prefill are read by the sender from the blocks: each send waits on
    the event finish() recorded on the engine's stream."""
    producer, log, control, pair = gloo_producer
    kv = make_kv(LAYOUT, 8, 2)
    producer.finish("r", 42, kv, [3, 4], 8)  # a run: sent in place, layer by layer
    assert control.wait_for(lambda: len(_entries(log, "send")) == LAYOUT.num_layers)
    (record,) = _entries(log, "record")
    assert record[1] == ENGINE
    sends = [i for i, e in enumerate(log) if e[0] == "send"]
    waits = [i for i, e in enumerate(log) if e[0] == "wait" and e[2] == record[2]]
    assert len(sends) == len(waits) == LAYOUT.num_layers
    assert log.index(record) < waits[0] and all(w < s for w, s in zip(waits, sends))
    assert same_bytes(pair.sent[0][0], kv[0][0, 3:5]) and same_bytes(pair.sent[0][1], kv[0][1, 3:5])


def _ipc_job(dst_ids: list[int], src_ids: list[int], kv: list[torch.Tensor], ready: str | None) -> SendJob:
    req = ProducerRequest("r", None, ProducerState.SENDING, remote_block_ids=dst_ids)
    return SendJob("layers", req, [1], source=(kv[1], src_ids), ready=ready)


def test_ipc_copy_ends_on_the_destination_devices_stream_and_is_synchronized_there():
    """Producer on one device, the consumer's cache on another: the copy runs with a stream
    of each device current, after the layer's event; the fence is an event recorded on the
    destination device's stream (where index_copy_ runs), and synchronized."""
    log: list = []
    streams = RecordingStreams(log)
    peer = [torch.zeros(LAYOUT.layer_shape(8), dtype=LAYOUT.torch_dtype) for _ in range(LAYOUT.num_layers)]
    pair = IpcPair(0, "cuda:0", peer, 1.0, streams)  # "cuda:0" only names the source device here
    kv = make_kv(LAYOUT, 8, 3)
    pair.write(_ipc_job([6, 1], [2, 7], kv, ready="layer-written"), (kv, [2, 7]))
    pair.synchronize(1.0)
    assert log[:2] == [("use", "stream:cuda:0", "stream:cpu"), ("wait", "stream:cuda:0", "layer-written")]
    (record,) = _entries(log, "record")
    assert record[1] == "stream:cpu"  # the destination device's stream
    assert log[-1] == ("synchronize", record[2])
    assert same_bytes(peer[1][:, [6, 1]], kv[1][:, [2, 7]])


def test_ipc_job_of_every_layer_between_two_single_allocation_pools_is_one_copy():
    """Both pools one allocation (as the model runner makes them): a job of every layer copies
    them all at once over the block-major views, a gather and a scatter or one strided copy; the
    bytes land in every layer, and closing the pair still drops the mapping."""
    log: list = []
    peer_pool = torch.zeros((LAYOUT.num_layers, *LAYOUT.layer_shape(8)), dtype=LAYOUT.torch_dtype)
    mapped = weakref.ref(peer_pool)
    peer = list(peer_pool.unbind(0))
    kv = list(torch.randn((LAYOUT.num_layers, *LAYOUT.layer_shape(8))).to(LAYOUT.torch_dtype).unbind(0))
    pair = IpcPair(0, "cpu", peer, 1.0, RecordingStreams(log))
    every = list(range(LAYOUT.num_layers))
    for dst_ids, src_ids in (([6, 1], [2, 7]), ([4, 5], [2, 3])):  # scattered, then one run each
        req = ProducerRequest("r", None, ProducerState.SENDING, remote_block_ids=dst_ids)
        job = SendJob("layers", req, every)
        assert pair._whole_pools(job, kv) is not None
        nbytes = pair.write(job, (kv, src_ids))
        assert nbytes == len(src_ids) * sum(layer[:, :1].nbytes for layer in kv)
        assert all(same_bytes(p[:, dst_ids], k[:, src_ids]) for p, k in zip(peer, kv))
    assert pair._whole_pools(SendJob("layers", req, every[1:]), kv) is None  # some layers only: one by one
    del peer, peer_pool
    pair.close()
    gc.collect()
    assert mapped() is None, "the pair still holds the consumer's cache"


def _ipc_done(log: list, streams: RecordingStreams, then=lambda: None) -> tuple[list, torch.Tensor]:
    """A cuda_ipc sender copies blocks [4, 3] of a layer into the peer's [0, 5], then sends DONE;
    ``then()`` runs once DONE is out, before the sender stops. Returns (peer cache, source KV)."""
    control = FakeControl(log)
    peer = [torch.zeros(LAYOUT.layer_shape(8), dtype=LAYOUT.torch_dtype) for _ in range(LAYOUT.num_layers)]
    sender = PairSender("p", b"d", config=TransferConfig(**FAST), stats=TransferStats(), budget=ByteBudget(1 << 20),
                        control=control, device="cpu", on_done_sent=lambda req: None,
                        on_failed=lambda link, why: None, streams=streams, table=ProducerTable())
    sender.start(None, "cuda_ipc", peer)
    kv = make_kv(LAYOUT, 8, 4)
    job = _ipc_job([0, 5], [4, 3], kv, ready="layer-written")
    try:
        sender.put(job)
        sender.put(SendJob("done", job.req))
        assert control.wait_for(lambda: ("reply", "done", "r") in log)
        then()
    finally:
        stop(sender)
    return peer, kv


def test_done_goes_out_only_after_the_copies_event_completed():
    log: list = []
    peer, kv = _ipc_done(log, RecordingStreams(log))
    fence = _entries(log, "record")[0]  # the first after the copies (the last one: closing the pair)
    assert fence[1] == "stream:cpu"
    assert index_of(log, ("wait", "stream:cpu", "layer-written")) < log.index(fence) \
        < index_of(log, ("synchronize", fence[2])) < index_of(log, ("reply", "done", "r"))
    assert same_bytes(peer[1][:, [0, 5]], kv[1][:, [4, 3]])


def test_closing_an_ipc_pair_drains_its_stream_then_drops_the_mapping():
    log: list = []
    peer = [torch.zeros(LAYOUT.layer_shape(4), dtype=LAYOUT.torch_dtype) for _ in range(LAYOUT.num_layers)]
    mapped = weakref.ref(peer[0])
    pair = IpcPair(0, "cpu", peer, 1.0, RecordingStreams(log))
    del peer
    pair.close()
    gc.collect()
    assert mapped() is None, "the pair still holds the consumer's cache"
    (record,) = _entries(log, "record")
    assert log == [record, ("synchronize", record[2]), ("release_ipc",)]


def test_a_silent_consumers_ipc_pair_is_closed_and_its_cache_unmapped():
    """A restarted decode daemon never says goodbye: its old pair is closed when its pings
    stop, and with it the mapping of the old cache (which would otherwise stay allocated)."""
    log: list = []
    failed: list[str] = []
    closed = threading.Event()
    peer = [torch.zeros(LAYOUT.layer_shape(4), dtype=LAYOUT.torch_dtype) for _ in range(LAYOUT.num_layers)]
    mapped = weakref.ref(peer[0])
    cfg = TransferConfig(**dict(FAST, timeout_s=0.2, heartbeat_s=0.05))
    control = FakeControl(log)
    sender = PairSender("p", b"d", config=cfg, stats=TransferStats(), budget=ByteBudget(1 << 20),
                        control=control, device="cpu", on_done_sent=lambda req: None,
                        on_failed=lambda link, why: (failed.append(why), closed.set()),
                        streams=RecordingStreams(log), table=ProducerTable())
    control.on_tick = lambda: sender.tick(time.monotonic())
    sender.start(None, "cuda_ipc", peer)
    del peer
    assert closed.wait(10)
    assert wait_for(lambda: ("release_ipc",) in log, 5)  # the pair closes off the I/O thread
    control.close()
    gc.collect()
    assert "consumer silent" in failed[0] and sender.broken
    assert mapped() is None, "the pair still holds the gone consumer's cache"
    assert log[-1] == ("release_ipc",) and log[-2][0] == "synchronize"


def test_a_pinging_consumers_pair_stays():
    """The same pair, but its consumer pings: still serving when the test checks it after the
    silence bound passed several times over (counted by the sender's own idle wake-ups)."""
    log: list = []
    cfg = TransferConfig(**dict(FAST, timeout_s=0.5, heartbeat_s=0.05))
    control = FakeControl(log)
    sender = PairSender("p", b"d", config=cfg, stats=TransferStats(), budget=ByteBudget(1 << 20),
                        control=control, device="cpu", on_done_sent=lambda req: None,
                        on_failed=lambda link, why: None, streams=RecordingStreams(log), table=ProducerTable())
    control.on_tick = lambda: sender.tick(time.monotonic())
    wakeups = threading.Semaphore(0)
    check = sender._check_consumer

    def counted_check(now: float) -> None:
        check(now)
        wakeups.release()

    sender._check_consumer = counted_check
    sender.start(None, "cuda_ipc", [torch.zeros(LAYOUT.layer_shape(4), dtype=LAYOUT.torch_dtype)])
    try:
        bound_wakeups = int(cfg.peer_silent_s / cfg.heartbeat_s)
        for _ in range(2 * bound_wakeups):
            sender.heard()
            assert wakeups.acquire(timeout=5)
        assert not sender.broken and not sender.closed
    finally:
        stop(sender)


@pytest.mark.parametrize("dst_ids,src_ids", [([4, 5, 6], [1, 2, 3]), ([6, 1, 3], [1, 2, 3]), ([2, 3, 4], [7, 0, 5]),
                                             ([7, 2, 0], [3, 6, 1])])
def test_ipc_block_copy_moves_the_same_blocks_in_every_layer(dst_ids, src_ids):
    """BlockCopy (index tensors made once per job) is ``dst[:, dst_ids] = src[:, src_ids]`` for each
    layer, whether either side's blocks form a run or not, and touches no other block."""
    from common.kv_transfer.cuda_ipc import BlockCopy
    kv = make_kv(LAYOUT, 8, 3)
    peer = [torch.zeros(LAYOUT.layer_shape(8), dtype=LAYOUT.torch_dtype) for _ in range(LAYOUT.num_layers)]
    copy = BlockCopy(dst_ids, src_ids, kv[0].device, peer[0].device)
    for layer in range(LAYOUT.num_layers):
        copy(peer[layer], kv[layer])
        assert same_bytes(peer[layer][:, dst_ids], kv[layer][:, src_ids])
        others = [b for b in range(8) if b not in dst_ids]
        assert not peer[layer][:, others].any()


class TimedCopies(RecordingStreams):
    """Copies that finish at once, or (``slow``) not within the quick wait; notes which thread
    waited each time and how long it would wait."""

    def __init__(self, log: list, slow: bool) -> None:
        super().__init__(log)
        self.slow, self.waits = slow, []

    def synchronize(self, event: str, timeout_s: float) -> bool:
        self.waits.append((threading.current_thread().name, timeout_s))
        self.log.append(("synchronize", event))
        return not (self.slow and len(self.waits) == 1)


@pytest.mark.parametrize("slow", [False, True], ids=["copies-done-at-once", "copies-still-running"])
def test_done_waits_for_short_copies_on_the_io_thread_and_for_long_ones_on_the_waiter(slow: bool):
    """cuda_ipc's DONE: copies that finish within QUICK_SYNC_S are waited for by the I/O thread
    itself (no hand-off to the waiter and back); longer ones by the waiter, on a new event. Either
    way DONE goes out only after a synchronize that said the copies finished."""
    log: list = []
    streams = TimedCopies(log, slow)
    before_done: list = []
    peer, kv = _ipc_done(log, streams, lambda: before_done.extend(streams.waits[:2 if slow else 1]))
    first, *rest = before_done
    assert first[1] == sender_mod.QUICK_SYNC_S  # the quick wait, on the I/O thread
    if slow:  # then the waiter's own thread, with the pair's whole timeout
        assert rest[0][0] != first[0] and rest[0][1] == FAST["timeout_s"]
    done_at = index_of(log, ("reply", "done", "r"))
    assert len([e for e in _entries(log, "synchronize") if log.index(e) < done_at]) == (2 if slow else 1)
    assert same_bytes(peer[1][:, [0, 5]], kv[1][:, [4, 3]])
