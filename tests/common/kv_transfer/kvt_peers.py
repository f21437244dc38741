"""Peer processes for the KV transfer tests (spawned; driven over a multiprocessing Pipe).

``serve_engine`` runs a KVEndpoint in a child and executes commands:
prefill (producer side), request/poll/fetch (consumer side), freeable, stats, stop.
``make_kv`` builds the same deterministic paged cache in any process.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from contextlib import contextmanager

import torch

from common.kv_layout import KVLayout
from common.kv_transfer.config import TransferConfig
from common.kv_transfer.endpoint import KVEndpoint


def make_kv(layout: KVLayout, num_blocks: int, seed: int) -> list[torch.Tensor]:
    """Random bit patterns viewed as the layout dtype (every byte value matters)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(layout.num_layers):
        shape = layout.layer_shape(num_blocks)
        numel = 1
        for d in shape:
            numel *= d
        nbytes = numel * torch.empty((), dtype=layout.torch_dtype).element_size()
        bits = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
        out.append(bits.view(layout.torch_dtype).view(shape))
    return out


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                              b.contiguous().view(torch.uint8))


def serve_engine(conn, layout: dict, config: dict, address: str = "127.0.0.1:0", device: str = "cpu",
                 transport: str = "auto") -> None:
    kvl = KVLayout.from_dict(layout)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    engine = KVEndpoint(address, kvl, TransferConfig(**config), device=device, transport=transport)
    conn.send(engine.address)
    freeable: set[str] = set()
    caches: dict[str, list[torch.Tensor]] = {}
    done: dict[str, int] = {}
    failed: dict[str, str] = {}
    shared: list[torch.Tensor] | None = None
    eager: dict[str, int] = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "prefill":
            rid, seed, num_blocks, block_ids, num_tokens, first_token, save, delay = args
            kv = [t.to(device) for t in make_kv(kvl, num_blocks, seed)]
            for layer in range(kvl.num_layers):
                time.sleep(delay)
                if save:
                    engine.producer.save_layer(rid, layer, kv[layer], block_ids)
            eager[rid] = engine.producer.queued_layers(rid)  # pushed while "prefill" ran
            engine.producer.finish(rid, first_token, kv, block_ids, num_tokens)
            conn.send("ok")
        elif cmd == "fault":  # kvt_faults.py: what this producer's tcp pair puts on the wire goes wrong
            from kvt_faults import install
            install(args[0])
            conn.send("ok")
        elif cmd == "eager":
            conn.send(eager.get(args[0], 0))
        elif cmd == "freeable":
            deadline = time.monotonic() + args[0]
            while True:  # polling is what enforces leases, so poll at least once
                freeable |= engine.producer.poll_freeable()
                if time.monotonic() >= deadline or (args[1] and set(args[1]) <= freeable):
                    break
                time.sleep(0.02)
            conn.send(sorted(freeable))
        elif cmd == "request_shared":  # later requests land in one cache, as in a daemon
            shared = [torch.zeros(kvl.layer_shape(args[0]), dtype=kvl.torch_dtype, device=device)
                      for _ in range(kvl.num_layers)]
            conn.send("ok")
        elif cmd == "request":
            rid, addr, block_ids, num_tokens, num_blocks = args
            caches[rid] = shared if shared is not None else \
                [torch.zeros(kvl.layer_shape(num_blocks), dtype=kvl.torch_dtype, device=device)
                 for _ in range(kvl.num_layers)]
            engine.consumer.request(rid, addr, block_ids, num_tokens, caches[rid])
            conn.send("ok")
        elif cmd == "poll":
            deadline = time.monotonic() + args[0]
            while time.monotonic() < deadline and not set(args[1]) <= (set(done) | set(failed)):
                d, f = engine.consumer.poll_finished()
                done.update(d)
                failed.update(f)
                time.sleep(0.02)
            conn.send((dict(done), dict(failed)))
        elif cmd == "fetch":
            conn.send([t.cpu() for t in caches[args[0]]])
        elif cmd == "stats":
            conn.send(engine.stats.snapshot())
        elif cmd == "wait_state":  # until the producer's view of a request is ``state``
            rid, state, timeout = args
            deadline = time.monotonic() + timeout
            while engine.producer.request_state(rid) != state and time.monotonic() < deadline:
                time.sleep(0.01)
            conn.send(engine.producer.request_state(rid))
        elif cmd == "pairs":
            conn.send(engine.pair_counts())
        elif cmd == "wait_pairs":  # until the live pairs are ``counts`` (or the timeout): the last seen
            counts, timeout = args
            deadline = time.monotonic() + timeout
            while engine.pair_counts() != counts and time.monotonic() < deadline:
                time.sleep(0.05)
            conn.send(engine.pair_counts())
        elif cmd == "gpu_free_bytes":  # free memory on the whole GPU, as the driver sees it
            torch.cuda.ipc_collect()
            conn.send(torch.cuda.mem_get_info(torch.device(device))[0])
        elif cmd == "stop":
            engine.close()
            conn.send("bye")
            return


class Peer:
    """Parent-side handle of a ``serve_engine`` child."""

    def __init__(self, layout: KVLayout, config: dict, address: str = "127.0.0.1:0", device: str = "cpu",
                 transport: str = "auto") -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (child, layout.to_dict(), config, address, device, transport)
        self.proc = ctx.Process(target=serve_engine, args=args, daemon=True)
        self.proc.start()
        if not self.conn.poll(30):
            self.kill()
            raise RuntimeError("peer did not start")
        self.address: str = self.conn.recv()

    def call(self, *cmd, timeout: float = 30.0):
        self.conn.send(cmd)
        if not self.conn.poll(timeout):
            raise TimeoutError(f"peer did not answer {cmd[0]}")
        return self.conn.recv()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()

    def stop(self) -> None:
        try:
            self.call("stop", timeout=15)
        finally:
            self.kill()


@contextmanager
def peer(layout: KVLayout, config: dict, address: str = "127.0.0.1:0", device: str = "cpu",
         transport: str = "auto"):
    p = Peer(layout, config, address, device, transport)
    try:
        yield p
    finally:
        p.kill()
