from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from common.kv_transfer.config import PairBrokenError
from common.kv_transfer.p2p_group import PairGroup, host_store
from common.kv_transfer.pipe import TensorPipe
from kvt_pipe_peer import run_child, samples


def _same(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def test_two_processes_exact_bytes_all_dtypes_and_none():
    store = host_store("127.0.0.1", 10)
    child = mp.get_context("spawn").Process(target=run_child, args=(store.port,), daemon=True)
    child.start()
    try:
        pipe = TensorPipe(PairGroup("gloo", 0, "127.0.0.1", store.port, timeout_s=10, store=store))
        for expected in samples():
            assert _same(pipe.recv_tensor(), expected)
        big = torch.zeros(10, 6)
        big[2:5] = torch.arange(18.0).view(3, 6)
        pipe.send_tensor(big[2:5])  # a contiguous view of a larger buffer
        into = torch.zeros(10, 6)
        pipe.pair.recv_into(torch.zeros(11, dtype=torch.int64))  # the header
        pipe.pair.recv_into(into[5:8])  # the payload lands in place
        assert torch.equal(into[5:8], big[2:5] * 2)
        pipe.close()
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0


def test_dead_peer_breaks_pair_within_timeout():
    store = host_store("127.0.0.1", 10)
    ctx = mp.get_context("spawn")
    child = ctx.Process(target=run_child, args=(store.port,), daemon=True)
    child.start()
    try:
        pair = PairGroup("gloo", 0, "127.0.0.1", store.port, timeout_s=10, store=store)
        child.kill()
        child.join(5)
        with pytest.raises(PairBrokenError):
            for _ in range(len(samples()) * 2 + 10):
                pair.recv_into(torch.zeros(16, dtype=torch.int64), timeout_s=2)
        assert pair.broken
        with pytest.raises(PairBrokenError):
            pair.send(torch.zeros(1))
    finally:
        child.kill()
        child.join(5)
