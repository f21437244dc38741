from __future__ import annotations

import multiprocessing as mp

import torch

from common.kv_transfer.lookup_buffer import LookupBuffer, prefix_match
from common.kv_transfer.p2p_group import PairGroup, host_store
from common.kv_transfer.pipe import TensorPipe
from kvt_buffer_peer import entry, run_producer


def test_prefix_match_with_roi():
    toks = torch.tensor([1, 2, 3, 4])
    assert prefix_match(toks, None, torch.tensor([1, 2]), None) == 2
    assert prefix_match(toks, None, torch.tensor([2, 3]), None) == 0
    roi = torch.tensor([False, True, True, True])
    assert prefix_match(toks, roi, torch.tensor([9, 2, 3]), torch.tensor([False, True, True])) == 2
    assert prefix_match(toks, None, None, None) == 1


def test_insert_drop_select_backpressure_and_close():
    store = host_store("127.0.0.1", 20)
    ctx = mp.get_context("spawn")
    parent, child_conn = ctx.Pipe()
    child = ctx.Process(target=run_producer, args=(store.port, child_conn), daemon=True)
    child.start()
    try:
        pipe = TensorPipe(PairGroup("gloo", 0, "127.0.0.1", store.port, timeout_s=20, store=store))
        buf = LookupBuffer(pipe, buffer_size_thresh=1, idle_timeout_s=20)
        assert parent.poll(20) and parent.recv() == "two inserted"
        assert not parent.poll(0.5)  # third insert is held back: buffer full
        # roi masks the first token, the rest is a prefix of entry 2
        got = buf.drop_select(torch.tensor([0, 7, 8]), torch.tensor([False, True, True]))
        want = entry([7, 8, 9, 10], 2.0)
        assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(got, want))
        assert parent.poll(20) and parent.recv() == "third inserted"
        got = buf.drop_select(torch.tensor([5, 6]), None)
        assert torch.equal(got[2], entry([5, 6, 7, 8], 3.0)[2])
        got = buf.drop_select(None, None)  # any entry
        assert torch.equal(got[0], torch.tensor([1, 2, 3, 4]))
        buf.close()
        child.join(20)
        assert child.exitcode == 0
        pipe.close()
    finally:
        if child.is_alive():
            child.kill()
            child.join(5)
