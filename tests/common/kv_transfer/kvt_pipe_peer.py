"""Child side of the pipe tests: joins a pair as rank 1 and streams ``samples()``."""

from __future__ import annotations

import torch

from common.kv_transfer.p2p_group import PairGroup
from common.kv_transfer.pipe import TensorPipe


def samples() -> list[torch.Tensor | None]:
    g = torch.Generator().manual_seed(3)

    def bits(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        n = torch.empty(shape, dtype=dtype).numel() * torch.empty((), dtype=dtype).element_size()
        return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).view(shape)

    out: list[torch.Tensor | None] = []
    for shape in [(7,), (3, 5), (2, 3, 4, 5), (2, 8, 16, 2, 64)]:
        out += [bits(torch.bfloat16, shape), bits(torch.float16, shape), bits(torch.float32, shape),
                bits(torch.int64, shape), torch.randint(0, 2, shape, generator=g).bool()]
    out += [None, torch.empty(0, 4), torch.tensor(3.5)]
    return out


def run_child(store_port: int) -> None:
    pipe = TensorPipe(PairGroup("gloo", 1, "127.0.0.1", store_port, timeout_s=10))
    for t in samples():
        pipe.send_tensor(t)
    echo = pipe.recv_tensor()
    pipe.send_tensor(echo * 2)
    pipe.close()
