"""One I/O thread per KV endpoint: transfers over tcp pairs add no thread on either side (the
control plane's thread reads and writes every pair's socket without waiting), a gloo pair adds
one waiter per side (torch's gloo work cannot be polled), and building a pair is the only
other thread, gone once the pair is in."""

from __future__ import annotations

import threading

import pytest
import torch

from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from helpers.waiting import wait_for
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from kvt_peers import make_kv, same_bytes
from test_kvt_engine import wait_finished


def kv_threads() -> list[str]:
    return sorted(t.name.split("-")[1] for t in threading.enumerate() if t.name.startswith("kv-") and t.is_alive())


@pytest.mark.parametrize("transport, waiters", [("tcp", []), ("gloo", ["wait", "wait"])])
def test_tcp_pairs_add_no_thread(transport, waiters, no_thread_leak):
    cfg = TransferConfig(**FAST)
    with KVEndpoint("127.0.0.1:0", LAYOUT, cfg, role="prefill", transport=transport) as p, \
            KVEndpoint("127.0.0.1:0", LAYOUT, cfg, role="decode", transport=transport) as d:
        assert kv_threads() == ["control", "control"]
        p_kv, d_kv = make_kv(LAYOUT, 16, 3), [torch.zeros_like(x) for x in make_kv(LAYOUT, 16, 0)]
        for i in range(3):  # one pair carries them all
            rid = f"r{i}"
            d.consumer.request(rid, p.address, [10 - i, 2 + i, 14], 3 * LAYOUT.block_size, d_kv)
            assert wait_for(lambda: p.producer.request_state(rid) == "pulled", 10)
            p.producer.finish(rid, 7 + i, p_kv, [1, 5 + i, 9], 3 * LAYOUT.block_size)
            done, failed = wait_finished(d, {rid})
            assert done == {rid: 7 + i} and failed == {}
            assert all(same_bytes(d_kv[x][:, [10 - i, 2 + i, 14]], p_kv[x][:, [1, 5 + i, 9]])
                       for x in range(LAYOUT.num_layers))
        assert wait_for(lambda: "pair" not in kv_threads(), 5), kv_threads()
        assert kv_threads() == sorted(["control", "control", *waiters])
        assert p.pair_counts() == d.pair_counts() == {transport: 1}
