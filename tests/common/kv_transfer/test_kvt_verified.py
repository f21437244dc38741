"""Verified KV (verify.py) across real processes: a producer child puts a fault on the wire
(kvt_faults.py) and the consumer here must refuse the KV before anything uses it, say why
and count it; a clean transfer after the fault still lands."""

from __future__ import annotations


import pytest

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from common.kv_transfer.messages import Done
from common.kv_transfer.verify import (BYTES, CHECKSUM, LAYERS, NOT_REQUESTED, STALE, KVRejected, check_done_identity,
                                       expected_nbytes, use_checksum)
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from kvt_peers import Peer, peer
from test_kvt_engine import P_BLOCKS, assert_landed, d_cache, slow_transfer_under_way, wait_finished


def _request(p, d, kv, rid: str, seed: int, d_ids: list[int], p_ids: list[int], tokens: int = 12) -> None:
    d.consumer.request(rid, p.address, d_ids, tokens, kv)
    assert p.call("wait_state", rid, "pulled", 10) == "pulled"
    p.call("prefill", rid, seed, P_BLOCKS, p_ids, tokens, 7, False, 0.0)


@pytest.mark.parametrize("fault,reason", [("truncate", BYTES), ("flip", CHECKSUM), ("stale", STALE)])
def test_damaged_or_stale_kv_fails_the_request_and_is_counted(fault, reason, no_thread_leak):
    # --kv-checksum on at the consumer turns the pair's checksums on (auto is off)
    config = TransferConfig(**FAST, checksum="on")
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, config) as d:
        p.call("fault", fault)
        kv = d_cache()
        _request(p, d, kv, "r1", 1, [0, 1, 2], [3, 4, 5])
        done, failed = wait_finished(d, {"r1"})
        assert done == {} and f"rejected ({reason})" in failed["r1"], failed
        assert d.stats.rejected_counts() == {reason: 1}
        if fault != "stale":  # the pair stays in step: the next request lands whole
            _request(p, d, kv, "r2", 2, [6, 7, 8], [9, 10, 11])
            assert wait_finished(d, {"r2"}) == ({"r2": 7}, {})
            assert_landed(kv, [6, 7, 8], 2, [9, 10, 11], 12)
        p.call("stop")


def test_done_for_a_request_never_asked_for_is_dropped_and_counted(no_thread_leak):
    with peer(LAYOUT, FAST) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
        p.call("fault", "ghost")
        kv = d_cache()
        _request(p, d, kv, "r1", 1, [0, 1, 2], [3, 4, 5])
        assert wait_finished(d, {"r1"}) == ({"r1": 7}, {})
        assert_landed(kv, [0, 1, 2], 1, [3, 4, 5], 12)
        _request(p, d, kv, "r2", 2, [6, 7, 8], [9, 10, 11])  # the ghost DONE after r1 was read by now
        assert wait_finished(d, {"r2"}) == ({"r2": 7}, {})
        assert d.stats.rejected_counts().get(NOT_REQUESTED, 0) >= 1
        p.call("stop")


def test_transfer_landing_after_its_blocks_were_reused_does_not_touch_them(no_thread_leak):
    """r1 landed and its blocks went to r2; r1's layers and DONE arrive again in front of r2's:
    they are dropped, not written into r2's blocks, and r2's KV is r2's."""
    # no deadline is under test here: a 2 s one could break the pair on a loaded machine and lose
    # the replay with it (the test would then see no rejection)
    patient = {**FAST, "timeout_s": 15.0, "lease_s": 30.0}
    with peer(LAYOUT, patient) as p, KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**patient)) as d:
        p.call("fault", "replay")
        kv = d_cache()
        _request(p, d, kv, "r1", 1, [0, 1, 2], [3, 4, 5])
        assert wait_finished(d, {"r1"}) == ({"r1": 7}, {})
        _request(p, d, kv, "r2", 2, [0, 1, 2], [9, 10, 11])  # r1's blocks, reused
        assert wait_finished(d, {"r2"}) == ({"r2": 7}, {})
        assert_landed(kv, [0, 1, 2], 2, [9, 10, 11], 12)
        assert d.stats.rejected_counts() == {NOT_REQUESTED: 1}
        p.call("stop")


def test_checksum_off_is_honoured_by_both_sides(no_thread_leak):
    """--kv-checksum off on the consumer beats on at the producer: the pair sends no checksums
    (a flipped byte goes through); identity, layer and byte counts are still checked."""
    cfg = TransferConfig(**FAST, checksum="off")
    with peer(LAYOUT, {**FAST, "checksum": "on"}) as p, KVEndpoint("127.0.0.1:0", LAYOUT, cfg) as d:
        p.call("fault", "flip")
        kv = d_cache()
        _request(p, d, kv, "r1", 1, [0, 1, 2], [3, 4, 5])
        assert wait_finished(d, {"r1"}) == ({"r1": 7}, {})
        assert d.stats.rejected_counts() == {}
        p.call("stop")


def test_prefill_restarted_mid_transfer_never_lands_partial_kv(no_thread_leak):
    p = Peer(LAYOUT, FAST)
    try:
        with KVEndpoint("127.0.0.1:0", LAYOUT, TransferConfig(**FAST)) as d:
            kv = d_cache()
            slow_transfer_under_way(p, d, kv)
            p.kill()
            p = Peer(LAYOUT, FAST, address=p.address)  # restarted while the consumer waits
            done, failed = wait_finished(d, {"r1"}, timeout=30)
            assert done == {} and "r1" in failed
            # asked again (as a migration would): the new process's KV lands whole, none of the old
            _request(p, d, kv, "r1", 5, [0, 1, 2], [6, 7, 8])
            assert wait_finished(d, {"r1"}) == ({"r1": 7}, {})
            assert_landed(kv, [0, 1, 2], 5, [6, 7, 8], 12)
            p.stop()
    finally:
        p.kill()


@pytest.mark.parametrize("transport", ["gloo", "tcp"])
@pytest.mark.parametrize("views", [False, True])
def test_pairs_checksum_what_they_move_and_land_it(views, transport, no_thread_leak):
    """--kv-checksum on over gloo and tcp: both sides' CRC-32s agree on a clean transfer, from and into
    whole caches or head slices of them (tensor-parallel routes and KV ranks: not contiguous)."""
    import time

    import torch

    from common.kv_layout import KVLayout
    from common.kv_transfer.paged import gather_blocks

    layout = KVLayout(num_layers=2, num_kv_heads=1 if views else 2, head_dim=4, block_size=4, dtype="float32")
    whole = KVLayout(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4, dtype="float32")
    p_kv = [torch.randn(whole.layer_shape(8)) for _ in range(2)]
    d_kv = [torch.zeros(whole.layer_shape(8)) for _ in range(2)]
    if views:  # head 1 of the prefill side into head 0 of the decode side
        p_kv, d_kv_used = [c[:, :, :, 1:2] for c in p_kv], [c[:, :, :, 0:1] for c in d_kv]
    else:
        d_kv_used = d_kv
    cfg = TransferConfig(**FAST, checksum="on")
    with KVEndpoint("127.0.0.1:0", layout, cfg, transport=transport) as p, \
            KVEndpoint("127.0.0.1:0", layout, cfg, transport=transport) as d:
        p.producer.table.hand_over("r")
        p.producer.finish("r", 5, p_kv, [1, 2, 3], 12)
        d.consumer.request("r", p.address, [4, 5, 6], 12, d_kv_used)
        deadline = time.monotonic() + 20
        while not (result := d.consumer.poll_finished()) != ({}, {}) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert result == ({"r": 5}, {})
        assert d.stats.rejected_counts() == {}
    for layer in range(2):
        assert torch.equal(gather_blocks(d_kv_used[layer], [4, 5, 6]), gather_blocks(p_kv[layer], [1, 2, 3]))
    if views:
        assert not d_kv[0][:, :, :, 1].any()  # the other head untouched


@pytest.mark.parametrize("consumer", ["auto", "on", "off"])
@pytest.mark.parametrize("producer", ["auto", "on", "off"])
def test_off_on_either_side_wins_then_on_and_auto_is_off(consumer, producer):
    """--kv-checksum as the handshake agrees it: a pair checksums only if neither side says off
    and one says on."""
    assert use_checksum(consumer, producer) is {("auto", "auto"): False, ("on", "auto"): True, ("auto", "on"): True,
                                                ("on", "on"): True}.get((consumer, producer), False)
    # a cuda_ipc pair has no bytes to hash (a GPU-to-GPU copy): never agreed, or every DONE would fail
    assert use_checksum(consumer, producer, "cuda_ipc") is False
    assert use_checksum(consumer, producer, "gloo") is use_checksum(consumer, producer, "tcp")


@pytest.mark.parametrize("landed, done, reason", [
    ({}, {}, None),  # whole: accepted
    ({"layers": {0, 1, 2}}, {}, LAYERS),  # one layer never landed
    ({}, {"num_layers": 3}, LAYERS),  # DONE speaks of another layer count
    ({"nbytes": -1}, {}, BYTES),  # fewer bytes landed than the request's blocks hold
    ({}, {"nonce": 8}, STALE),  # another transfer's DONE
    ({"checksums": {0: 1, 1: 2, 2: 3, 3: 5}}, {}, CHECKSUM),  # layer 3 differs
])
def test_a_done_is_accepted_only_for_this_transfers_whole_kv(landed, done, reason):
    """check_done_identity, case by case: each way KV can be partial or another's has its reason."""
    nbytes = expected_nbytes(LAYOUT, 3)
    msg = Done(**{"request_id": "r", "nonce": 7, "num_layers": LAYOUT.num_layers, "nbytes": nbytes,
                  "checksums": [1, 2, 3, 4], **done})
    got = {"layers": set(range(LAYOUT.num_layers)), "nbytes": nbytes, "checksums": {0: 1, 1: 2, 2: 3, 3: 4}}
    got.update({k: (nbytes - 1 if v == -1 else v) for k, v in landed.items()})
    if reason is None:
        check_done_identity(msg, nonce=7, layout=LAYOUT, num_blocks=3, **got)
        return
    with pytest.raises(KVRejected) as rejected:
        check_done_identity(msg, nonce=7, layout=LAYOUT, num_blocks=3, **got)
    assert rejected.value.reason == reason


class _Stub:
    """What a PairReceiver reaches of its owner and tcp pair, recorded."""

    def __init__(self) -> None:
        self.sent: list = []
        self.rejected: list[str] = []
        self.failed: list[tuple[str, str]] = []
        self.stats = self
        self.config = TransferConfig(**{**FAST, "lease_s": 8.0, "timeout_s": 3.0})

    def reject(self, reason: str) -> None:
        self.rejected.append(reason)

    def send_message(self, data: bytes) -> None:
        from common.kv_transfer.messages import decode
        self.sent.append(decode(data))


def _tcp_receiver(stub: _Stub):
    from common.kv_transfer.receiver import PairReceiver
    r = PairReceiver(stub, "127.0.0.1:1")  # type: ignore[arg-type]
    r.transport, r.pair, r.pair_id = "tcp", stub, "pair-1"
    return r


def test_a_done_no_transfer_waits_for_is_acked_so_the_producer_frees_its_blocks():
    """The producer holds a request's blocks until the consumer ACKs its DONE, and the pair's pings
    renew that lease: a DONE for a transfer this side already failed (its deadline ran out on a slow
    link: the multi-host netem test saw the prefill node hold its blocks) must still be ACKed."""
    stub = _Stub()
    _tcp_receiver(stub)._finish(Done(request_id="given-up", pair_id="pair-1", first_token=1))
    assert [(type(m).__name__, m.request_id) for m in stub.sent] == [("Ack", "given-up")]
    assert stub.rejected == [NOT_REQUESTED]


def test_a_layer_still_arriving_keeps_its_transfer_alive_past_the_limit():
    """tcp: a transfer with no layer landed for lease + timeout fails, unless bytes of its layer are
    arriving now (a lossy link can take longer than that for one layer); one with none fails."""
    import time
    from types import SimpleNamespace

    from common.kv_transfer.consumer_table import Transfer
    stub = _Stub()
    r = _tcp_receiver(stub)
    failed: list[str] = []
    r._fail_fenced = lambda t, reason, fence=None: failed.append(t.request_id)  # type: ignore[method-assign]
    r._take = lambda request_id: r.transfers.pop(request_id)  # type: ignore[method-assign]
    now = time.monotonic()
    for rid in ("arriving", "silent"):
        r.transfers[rid] = Transfer(rid, started=now - 20.0)
    r._reader = SimpleNamespace(request_id="arriving", mid_frame=lambda: True, last_byte=now - 1.0)  # type: ignore[assignment]
    r._last_ping = now  # no ping due: only the deadlines are under test
    r._heartbeat(now)
    assert failed == ["silent"] and list(r.transfers) == ["arriving"]
