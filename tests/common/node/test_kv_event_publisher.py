"""The daemon's KV events: the block manager's changes, numbered and sealed on a PUB socket in
vLLM's layout, a replay ROUTER, and a full queue that drops, counts and leaves a gap."""

from __future__ import annotations

import struct

import msgpack
import pytest
import zmq

from common.cluster_auth import ClusterKey, kv_events_sealer, registry_sealer
from common.engine.block_manager import BlockManager
from common.engine.cache_events import AllBlocksCleared, BlockRemoved, BlockStored
from common.kv_events import END_SEQ, EventFormatError, decode_batch, seq_bytes
from common.node.kv_event_publisher import REPLAYS_PER_S, KVEventPublisher
from tests.helpers.waiting import wait_until

H = [bytes([i]) * 16 for i in range(8)]

# vLLM's structs (vllm/distributed/kv_events.py), field by field: msgspec's array_like layout puts
# the tag first, then the fields in this order, and a batch is [ts, events]
VLLM_FIELDS = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def as_vllm(payload: bytes) -> tuple[float, list[dict]]:
    """Decode a batch the way a vLLM indexer's msgspec decoder reads it: arrays in field order."""
    ts, events = msgpack.unpackb(payload, raw=False)
    out = []
    for tag, *values in events:
        names = VLLM_FIELDS[tag]
        assert len(values) == len(names), f"{tag}: {values}"
        out.append({"type": tag, **dict(zip(names, values))})
    return ts, out


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def started(bm: BlockManager, key: ClusterKey | None = None, **kw) -> KVEventPublisher:
    pub = KVEventPublisher("127.0.0.1", "127.0.0.1", bm.block_size, bm.cached_hashes, key=key, **kw)
    bm.events = pub.put
    pub.start()
    return pub


def subscribe(ctx: zmq.Context, pub: KVEventPublisher) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(f"tcp://{pub.endpoint}")
    return sub


def replay(ctx: zmq.Context, pub: KVEventPublisher, start: int, key: ClusterKey | None = None) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://{pub.replay_endpoint}")
    frames = [b"", seq_bytes(start)]
    dealer.send_multipart(frames + kv_events_sealer(key).frames(frames[1])[1:])
    answers = []
    try:
        while True:
            assert dealer.poll(5000), "no replay answer"
            answer = dealer.recv_multipart()
            answers.append(answer)
            if answer[1] == END_SEQ:
                return answers
    finally:
        dealer.close()


def fill(bm: BlockManager, n: int) -> list[int]:
    blocks = bm.allocate(n)
    for i, b in enumerate(blocks):
        bm.cache_block(b, H[i], H[i - 1] if i else None, tuple(range(i * bm.block_size, (i + 1) * bm.block_size)))
    return blocks


def test_block_manager_reports_stored_evicted_and_cleared() -> None:
    bm, seen = BlockManager(4, 2, True), []
    bm.events = seen.append
    blocks = fill(bm, 2)
    bm.cache_block(blocks[0], H[0])  # already named: no second event
    bm.release(blocks)
    bm.allocate(3)  # two empty blocks, then the least recently freed cached one
    assert seen == [BlockStored((H[0],), None, (0, 1), 2), BlockStored((H[1],), H[0], (2, 3), 2),
                    BlockRemoved((H[1],))]  # released last block first: its tail goes first
    assert bm.clear_cached() == 1 and seen[-1] == AllBlocksCleared() and bm.cached_hashes() == []
    assert bm.num_free_blocks == 1


def test_batches_are_numbered_in_vllm_layout_and_replayed(ctx) -> None:
    bm = BlockManager(4, 2, True)
    pub = started(bm)
    try:
        sub = subscribe(ctx, pub)
        wait_until(lambda: replay(ctx, pub, 0)[0][1] == seq_bytes(0), "the first batch (cleared) published")
        fill(bm, 2)
        seqs, events = [], []
        while len(events) < 2:  # the two stores, in one batch or two
            assert sub.poll(5000)
            topic, seq, payload = sub.recv_multipart()
            assert topic == b""
            seqs.append(struct.unpack(">q", seq)[0])
            events += [e for e in as_vllm(payload)[1] if e["type"] == "BlockStored"]
        assert seqs[-1] == pub.seq and seqs == list(range(seqs[0], seqs[-1] + 1))  # one number per batch
        assert events[0] == {"type": "BlockStored", "block_hashes": [H[0]], "parent_block_hash": None,
                             "token_ids": [0, 1], "block_size": 2, "lora_id": None, "medium": None,
                             "lora_name": None}
        assert events[1]["parent_block_hash"] == H[0] and events[1]["token_ids"] == [2, 3]
        answers = replay(ctx, pub, 0)
        assert [a[1] for a in answers] == [seq_bytes(s) for s in range(pub.seq + 1)] + [END_SEQ]
        assert as_vllm(answers[0][2])[1] == [{"type": "AllBlocksCleared"}]
        assert replay(ctx, pub, 5) == [[b"", END_SEQ, b""]]  # nothing after the last
        sub.close()
    finally:
        pub.stop()


def test_replay_too_old_gets_a_snapshot_of_the_cache(ctx) -> None:
    bm = BlockManager(8, 2, True)
    pub = started(bm, buffer_bytes=1)  # keeps only the last batch
    try:
        wait_until(lambda: pub.seq == 0, "the first batch published")
        fill(bm, 3)
        wait_until(lambda: len(bm.cached_hashes()) == 3 and pub._queue.empty() and pub.seq > 0, "published")
        answers = replay(ctx, pub, 0)
        assert len(answers) == 2 and answers[0][1] == seq_bytes(pub.seq)
        _, events = as_vllm(answers[0][2])
        assert events[0] == {"type": "AllBlocksCleared"}
        assert sorted(events[1]["block_hashes"]) == H[:3] and pub.snapshots == 1
    finally:
        pub.stop()


def test_full_queue_drops_counts_and_leaves_a_gap(ctx) -> None:
    bm = BlockManager(8, 2, True)
    pub = KVEventPublisher("127.0.0.1", "127.0.0.1", 2, bm.cached_hashes, max_queue=2)
    bm.events = pub.put  # not started: nothing drains the queue (the cleared event fills one slot)
    blocks = fill(bm, 3)
    assert (pub.dropped, pub.pending) == (2, 2)
    pub.start()
    try:
        wait_until(lambda: pub.seq == 1 and pub.pending == 0, "the queued batch sent as number 1: 0 skipped for "
                   "what was dropped")
        assert [a[1] for a in replay(ctx, pub, 1)] == [seq_bytes(1), END_SEQ]
        snapshot = replay(ctx, pub, 0)  # 0 was never sent: a subscriber that asks for it gets the cache
        assert [a[1] for a in snapshot] == [seq_bytes(1), END_SEQ] and pub.snapshots == 1
        assert sorted(as_vllm(snapshot[0][2])[1][1]["block_hashes"]) == H[:3]
        bm.free(blocks)
        bm.allocate(8)  # evicts all three: published after 1 (one number more if the tiny queue dropped one)
        wait_until(lambda: pub.seq == 2 + (pub.dropped > 2), "the eviction published")
    finally:
        pub.stop()


def test_sealed_under_a_key_and_unsealed_replay_requests_unanswered(ctx) -> None:
    key = ClusterKey(b"k" * 32)
    bm = BlockManager(4, 2, True)
    pub = started(bm, key=key)
    try:
        sub = subscribe(ctx, pub)
        wait_until(lambda: replay(ctx, pub, 0, key)[0][1] == seq_bytes(0), "published")
        fill(bm, 1)
        assert sub.poll(5000)
        _, seq, payload, seal = sub.recv_multipart()
        sealer = kv_events_sealer(key)
        assert sealer.open([seq + payload, seal]) == (seq + payload, None)
        assert registry_sealer(key).open([seq + payload, seal])[1] == "bad_signature"  # one purpose's seal only
        assert all(len(a) == 4 for a in replay(ctx, pub, 0, key))
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://{pub.replay_endpoint}")
        dealer.send_multipart([b"", seq_bytes(0)])  # keyless request to a keyed publisher
        dealer.send_multipart([b"garbage"])
        assert not dealer.poll(300)
        assert replay(ctx, pub, 0, key)  # and it still answers
        dealer.close()
        sub.close()
    finally:
        pub.stop()


@pytest.mark.parametrize("payload", [b"\xc1", msgpack.packb({"a": 1}), msgpack.packb([1.0, [["Nope"]]]),
                                     msgpack.packb([1.0, [["BlockStored", [1, 2]]]]),
                                     msgpack.packb([1.0, [["BlockRemoved", [b"x" * 100]]]]), b"\x00" * (9 << 20)])
def test_decoding_refuses_what_is_not_our_layout(payload: bytes) -> None:
    with pytest.raises(EventFormatError):
        decode_batch(payload)


def test_replays_are_answered_at_a_bounded_rate(ctx) -> None:
    bm = BlockManager(4, 2, True)
    pub = started(bm)
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://{pub.replay_endpoint}")
        for _ in range(REPLAYS_PER_S + 10):  # a flood: each could cost a snapshot
            dealer.send_multipart([b"", seq_bytes(0)])
        wait_until(lambda: pub.replays + pub.replays_refused == REPLAYS_PER_S + 10, "every request read")
        assert pub.replays <= REPLAYS_PER_S + 1 and pub.replays_refused >= 9
    finally:
        pub.stop()


def test_a_fixed_port_binds_there_and_the_replay_next_to_it_and_a_taken_one_fails_the_start(ctx) -> None:
    """--kv-events-port: the PUB on the port, the replay ROUTER on the next (a firewall names both); a
    port another process holds fails the start instead of moving elsewhere."""
    from tests.helpers.ports import free_port_run

    port = free_port_run(2)
    bm = BlockManager(4, 2, True)
    pub = started(bm, port=port)
    try:
        assert (pub.endpoint, pub.replay_endpoint) == (f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}")
        assert replay(ctx, pub, 0)[-1][1] == END_SEQ  # the replay socket answers at port + 1
        clash = KVEventPublisher("127.0.0.1", "127.0.0.1", 2, bm.cached_hashes, port=port)
        with pytest.raises(zmq.ZMQError):
            clash.start()
        clash.stop()
    finally:
        pub.stop()


def test_tier_events_carry_their_medium_and_pool_events_stay_nil() -> None:
    """A KV tier's blocks (common/engine/kv_tiers.py) name their medium in vLLM's field; the pool's
    keep nil (the wire unchanged without tiers), and vLLM's "GPU" reads as the pool."""
    from common.kv_events import Removed, Stored, encode_batch, encode_event

    h = b"h" * 16
    events = [encode_event(BlockStored((h,), None, (), 16)), encode_event(BlockStored((h,), None, (), 0, medium="DISK")),
              encode_event(BlockRemoved((h,), medium="CPU")), ["BlockStored", [h], None, [], 16, None, "GPU", None]]
    assert events[0][6] is None and events[1][6] == "DISK" and events[2][2] == "CPU"
    assert decode_batch(encode_batch(events)) == [Stored((h,)), Stored((h,), "DISK"), Removed((h,), "CPU"), Stored((h,))]
    with pytest.raises(EventFormatError):
        decode_batch(encode_batch([["BlockRemoved", [h], 7]]))
