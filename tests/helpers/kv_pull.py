"""Pull a request's KV from a real prefill daemon into a fresh cache, as a decode node would."""

from __future__ import annotations

import time

import torch

from common.kv_layout import KVLayout
from common.kv_transfer.endpoint import KVEndpoint


def pull_into_blocks(consumer: KVEndpoint, prefill, rid: str, num_tokens: int, layout: KVLayout,
                     blocks: list[int], timeout: float = 30.0) -> list[torch.Tensor]:
    """Ask ``prefill`` (a helpers.cluster process) for ``rid``'s KV into ``blocks`` of a fresh
    4-block cache and wait until it lands; fails with the daemon's log tail if it does not."""
    kv = [torch.zeros(layout.layer_shape(4), dtype=layout.torch_dtype) for _ in range(layout.num_layers)]
    consumer.consumer.request(rid, prefill.kv_addr, blocks, num_tokens, kv)
    done: dict = {}
    failed: dict = {}
    deadline = time.monotonic() + timeout
    while not (done or failed) and time.monotonic() < deadline:
        d, f = consumer.consumer.poll_finished()
        done.update(d)
        failed.update(f)
        time.sleep(0.01)
    assert rid in done, (done, failed, prefill.log_tail())
    return kv
