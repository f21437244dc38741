"""A producer closes a pair that carried no transfer for ``pair_idle_s`` (issue 22, finding 4);
the consumer builds a new one for its next request."""

from __future__ import annotations

import time

import torch


from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint
from kvt_fixtures import FAST, LAYOUT, no_thread_leak  # noqa: F401
from kvt_peers import make_kv
from test_kvt_engine import D_BLOCKS, wait_finished


def wait_for(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _cache() -> list[torch.Tensor]:
    return [torch.zeros(LAYOUT.layer_shape(D_BLOCKS), dtype=LAYOUT.torch_dtype) for _ in range(LAYOUT.num_layers)]


def _transfer(p: KVEndpoint, d: KVEndpoint, rid: str) -> None:
    p.producer.finish(rid, 5, make_kv(LAYOUT, 8, 1), [0, 1], 8)
    d.consumer.request(rid, p.address, [2, 3], 8, _cache())
    assert wait_finished(d, {rid}) == ({rid: 5}, {})


def test_idle_pair_is_closed_and_rebuilt(no_thread_leak):
    cfg = TransferConfig(**{**FAST, "pair_idle_s": 1.0})
    with KVEndpoint("127.0.0.1:0", LAYOUT, cfg) as p, KVEndpoint("127.0.0.1:0", LAYOUT, cfg) as d:
        _transfer(p, d, "r1")
        assert len(p.producer.pair_transports()) == 1
        assert wait_for(lambda: not p.producer.pair_transports(), 20), "the idle pair was kept"
        _transfer(p, d, "r2")
