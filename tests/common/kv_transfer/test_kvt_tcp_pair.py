"""The tcp data plane on its own: scattered blocks in and out, strangers, dead and silent peers."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest
import torch

from common.kv_transfer.config import PairBrokenError
from common.kv_transfer.paged import block_runs
from common.kv_transfer.paged import StagingBuffer
from common.kv_transfer.tcp_pair import IOV_MAX, KV, MESSAGE, FrameReader, TcpListener, TcpPair, kv_views, layer_buffers


def block_buffers(kv_caches, layers: list[int], block_ids: list[int]) -> list:
    """Byte views of ``kv[l][:, block_ids]`` for each of ``layers``, back to back: one message."""
    runs = block_runs(block_ids)
    return [buf for layer in layers for buf in layer_buffers(kv_caches[layer], runs)]


def make_pair(timeout_s: float = 5.0, stranger: bytes | None = None) -> tuple[TcpPair, TcpPair]:
    listener = TcpListener("127.0.0.1", timeout_s)
    box: dict = {}
    t = threading.Thread(target=lambda: box.setdefault("p", TcpPair(0, timeout_s, "pid42",
                                                                    listener=listener)))
    t.start()
    if stranger is not None:  # connects first with the wrong id: must be dropped, not paired
        with socket.create_connection(("127.0.0.1", listener.port)) as s:
            s.sendall(stranger)
            assert s.recv(1) == b""  # the producer closed it
    d = TcpPair(1, timeout_s, "pid42", host="127.0.0.1", port=listener.port)
    t.join(10)
    return box["p"], d


def test_block_runs_merge_ascending_neighbours_only():
    assert block_runs([4, 5, 9, 2, 3, 3]) == [slice(4, 6), slice(9, 10), slice(2, 4), slice(3, 4)]
    assert block_runs([]) == []


def test_scattered_blocks_move_without_copies_past_iov_max():
    g = torch.Generator().manual_seed(1)
    src = [torch.randint(0, 2**15, (2, 3000, 2, 3), dtype=torch.int16, generator=g) for _ in range(2)]
    dst = [torch.zeros(2, 3000, 2, 3, dtype=torch.int16) for _ in range(2)]
    src_ids = torch.randperm(3000, generator=g)[:1500].tolist()  # ~1500 runs a layer: past IOV_MAX
    dst_ids = torch.randperm(3000, generator=g)[:1500].tolist()
    assert len(block_buffers(src, [0, 1], src_ids)) > IOV_MAX
    p, d = make_pair()
    try:
        t = threading.Thread(target=p.send, args=(block_buffers(src, [0, 1], src_ids),))
        t.start()
        d.recv_into(block_buffers(dst, [0, 1], dst_ids))
        t.join(10)
        for layer in range(2):
            assert torch.equal(dst[layer][:, dst_ids], src[layer][:, src_ids])
            untouched = sorted(set(range(3000)) - set(dst_ids))
            assert torch.count_nonzero(dst[layer][:, untouched]) == 0
    finally:
        p.close()
        d.close()


def test_stranger_with_wrong_pair_id_is_dropped():
    p, d = make_pair(stranger=b"notit")
    try:
        x = torch.arange(10, dtype=torch.int64)
        y = torch.zeros(10, dtype=torch.int64)
        p.send([x])
        d.recv_into([y])
        assert torch.equal(x, y)
    finally:
        p.close()
        d.close()


def test_closed_peer_breaks_the_pair_and_it_stays_broken():
    p, d = make_pair()
    p.close()
    with pytest.raises(PairBrokenError, match="tcp transfer failed"):
        d.recv_into([torch.zeros(1 << 20, dtype=torch.uint8)])
    assert d.broken
    with pytest.raises(PairBrokenError, match="rebuild"):
        d.recv_into([torch.zeros(1, dtype=torch.uint8)])
    d.close()


def test_silent_peer_fails_at_the_deadline():
    p, d = make_pair(timeout_s=0.3)
    try:
        with pytest.raises(PairBrokenError, match="no byte moved for 0.3 s"):
            d.recv_into([torch.zeros(8, dtype=torch.uint8)])
    finally:
        p.close()
        d.close()


def test_frames_carry_kv_into_blocks_and_messages_in_band():
    src = [torch.arange(2 * 6 * 4, dtype=torch.int16).reshape(2, 6, 4) for _ in range(2)]
    dst = [torch.zeros(2, 6, 4, dtype=torch.int16) for _ in range(2)]
    p, d = make_pair()
    try:
        assert p.send_kv("req-1", src, [0, 1], [4, 5, 1]) == 2 * 2 * 3 * 4 * 2  # layers x K,V x blocks x 4 int16
        p.send_message(b"\x81\xa1v\x01")
        frame, msg = read_frames(d, lambda f: (block_buffers(dst, [0, 1], [0, 2, 3]), None), 2)
        assert (frame.kind, frame.request_id, frame.layers, frame.num_blocks) == (KV, "req-1", (0, 1), 3)
        assert all(torch.equal(dst[i][:, [0, 2, 3]], src[i][:, [4, 5, 1]]) for i in range(2))
        assert msg.kind == MESSAGE and msg.payload == b"\x81\xa1v\x01"
    finally:
        p.close()
        d.close()



def read_frames(d: TcpPair, on_kv, count: int, deadline_s: float = 10.0) -> list:
    """Feed a FrameReader from ``d`` (as the I/O thread does: when readable) until ``count``
    frames are in; returns them (a KV frame's bytes land where ``on_kv`` says)."""
    frames: list = []

    def kv(frame):
        views, then = on_kv(frame)
        frames.append(frame)
        return views, then
    reader = FrameReader(d, kv, frames.append)
    end = time.monotonic() + deadline_s
    while len(frames) < count or reader.mid_frame():
        assert time.monotonic() < end, f"{len(frames)} of {count} frames before the deadline"
        if select.select([d.fileno()], [], [], 0.1)[0]:
            reader.feed()
    return frames


def test_send_kv_moves_layer_by_layer_with_its_trailer_behind():
    """``send_kv``: one KV frame from scattered blocks (the header's byte count is computed,
    not summed from views), the DONE-like trailer right behind; a FrameReader lands it."""
    g = torch.Generator().manual_seed(3)
    src = {layer: torch.randint(0, 2**15, (2, 40, 3, 2), dtype=torch.int16, generator=g) for layer in (1, 3, 4)}
    dst = [torch.zeros(2, 40, 3, 2, dtype=torch.int16) for _ in range(5)]
    src_ids, dst_ids = [9, 10, 2, 30, 31, 32, 5], [0, 1, 2, 17, 8, 9, 39]
    p, d = make_pair()
    try:
        trailer = p.message_frame(b"\x81\xa1v\x02")
        sent = {}
        t = threading.Thread(target=lambda: sent.setdefault("n", p.send_kv("req-7", src, [3, 1, 4], src_ids, trailer)))
        t.start()
        frame, msg = read_frames(d, lambda f: kv_views(dst, f.layers, dst_ids, StagingBuffer()), 2)
        assert (frame.kind, frame.request_id, frame.layers, frame.num_blocks) == (KV, "req-7", (3, 1, 4), 7)
        assert frame.nbytes == 3 * 2 * 7 * 3 * 2 * 2  # layers x K,V x blocks x 3 x 2 int16
        assert msg.kind == MESSAGE and msg.payload == b"\x81\xa1v\x02"
        t.join(10)
        assert sent["n"] == frame.nbytes
        for layer in (1, 3, 4):
            assert torch.equal(dst[layer][:, dst_ids], src[layer][:, src_ids])
        assert torch.count_nonzero(dst[0]) == 0 and torch.count_nonzero(dst[2]) == 0
    finally:
        p.close()
        d.close()


def wire_bytes(send) -> bytes:
    """What ``send(producer_pair)`` puts on a tcp pair's wire, read raw on the other end."""
    p, d = make_pair()
    try:
        send(p)
        p.close()
        chunks = []
        while chunk := d._sock.recv(1 << 16):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        d.close()


def socket_end(sock: socket.socket) -> TcpPair:
    """A TcpPair's consumer end over an existing socket (the reader needs its ``recv_some``)."""
    end = TcpPair.__new__(TcpPair)
    end._sock, end.broken = sock, False
    return end


def test_the_reader_lands_a_frame_that_comes_a_few_bytes_at_a_time():
    """The I/O thread never waits for a whole message: bytes coming 7 at a time land where
    they belong, a head-slice layer (not contiguous) through staging, then scattered."""
    g = torch.Generator().manual_seed(4)
    src = [torch.randint(0, 2**15, (2, 8, 4, 2), dtype=torch.int16, generator=g) for _ in range(2)]
    whole = torch.zeros(2, 8, 8, 2, dtype=torch.int16)
    dst = [torch.zeros(2, 8, 4, 2, dtype=torch.int16), whole[:, :, 4:]]  # layer 1: a slice of the heads
    raw = wire_bytes(lambda p: (p.send_kv("req-9", src, [0, 1], [1, 2, 6]), p.send_message(b"\x81\xa1v\x03")))
    a, b = socket.socketpair()
    frames: list = []
    reader = FrameReader(socket_end(b), lambda f: frames.append(f) or kv_views(dst, f.layers, [5, 0, 3],
                                                                               StagingBuffer()), frames.append)
    try:
        for i in range(0, len(raw), 7):
            a.sendall(raw[i:i + 7])
            reader.feed()  # reads what is there, returns without waiting for the rest
            assert reader.mid_frame() == (0 < i + 7 < len(raw))
        for layer in (0, 1):
            assert torch.equal(dst[layer][:, [5, 0, 3]], src[layer][:, [1, 2, 6]])
        assert torch.count_nonzero(whole[:, :, :4]) == 0  # the other heads untouched
        assert [f.kind for f in frames] == [KV, MESSAGE] and frames[1].payload == b"\x81\xa1v\x03"
    finally:
        a.close()
        b.close()


def test_a_diverted_frame_lands_nothing_in_the_blocks_and_the_stream_stays_in_step():
    """A request dropped while its bytes arrive (aborted): the rest of them go to scratch, the
    blocks keep what they had from then on, and the next message reads right."""
    src = [torch.full((2, 4, 64), 7, dtype=torch.int16)]
    dst = [torch.zeros(2, 4, 64, dtype=torch.int16)]
    raw = wire_bytes(lambda p: (p.send_kv("req-3", src, [0], [0, 1, 2, 3]), p.send_message(b"\x81\xa1v\x04")))
    a, b = socket.socketpair()
    frames: list = []
    reader = FrameReader(socket_end(b), lambda f: frames.append(f) or kv_views(dst, f.layers, [0, 1, 2, 3],
                                                                               StagingBuffer()), frames.append)
    try:
        a.sendall(raw[:100])  # the header and the start of the keys
        reader.feed()
        assert reader.request_id == "req-3" and reader.mid_frame()
        landed = int(torch.count_nonzero(dst[0]))
        reader.divert()
        a.sendall(raw[100:])
        reader.feed()
        assert int(torch.count_nonzero(dst[0])) == landed < dst[0].numel()
        assert [f.kind for f in frames] == [KV, MESSAGE] and frames[1].payload == b"\x81\xa1v\x04"
        assert not reader.mid_frame()
    finally:
        a.close()
        b.close()


def test_a_bad_frame_header_breaks_the_pair():
    p, d = make_pair()
    try:
        p.send([torch.zeros(64, dtype=torch.uint8)])  # not a frame: the stream is out of step
        with pytest.raises(PairBrokenError, match="out of step"):
            read_frames(d, lambda f: ([], None), 1)
        assert d.broken
    finally:
        p.close()
        d.close()
