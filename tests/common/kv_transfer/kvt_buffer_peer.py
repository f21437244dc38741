"""Child side of the lookup-buffer test: a producer inserting three entries."""

from __future__ import annotations

import torch

from common.kv_transfer.lookup_buffer import LookupBuffer
from common.kv_transfer.p2p_group import PairGroup
from common.kv_transfer.pipe import TensorPipe


def entry(tokens: list[int], fill: float) -> list[torch.Tensor]:
    t = torch.tensor(tokens)
    kv = torch.full((len(tokens), 2, 4), fill, dtype=torch.bfloat16)
    return [t, torch.ones(len(tokens), dtype=torch.bool), kv, -kv, torch.full((len(tokens), 8), fill)]


def run_producer(store_port: int, conn) -> None:
    pipe = TensorPipe(PairGroup("gloo", 1, "127.0.0.1", store_port, timeout_s=20))
    one = sum(t.numel() * t.element_size() for t in entry([1, 2, 3, 4], 0))
    buf = LookupBuffer(pipe, buffer_size_thresh=2 * one, idle_timeout_s=20)
    buf.insert(*entry([1, 2, 3, 4], 1.0))
    buf.insert(*entry([7, 8, 9, 10], 2.0))
    conn.send("two inserted")
    buf.insert(*entry([5, 6, 7, 8], 3.0))  # full: waits until the consumer drains one
    conn.send("third inserted")
    buf.close()  # returns once the consumer closed
    pipe.close()
