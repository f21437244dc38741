"""KV transfer bandwidth: our engine vs raw TCP vs a plain tensor copy, in one run.

    python bench/kv_transfer.py [--repeats 3]

A child process plays the prefill side (our producer engine and a raw TCP sender); this
process plays the decode side. "engine" times a whole transfer as the decode daemon sees
it: ``consumer.request`` -> PULL -> per-layer notice + gloo send, gathered from and
scattered into paged blocks -> DONE. "pair" is our gloo pair alone, one message of the
row's size (2 MB messages for the paged row, which the engine coalesces into
``coalesce_bytes`` messages). "raw TCP" is sendall/recv_into into a warmed buffer (32
back-to-back 2 MB sends for the paged row). Prints a markdown table of medians over the
repeats; the ratio is the median of per-repeat ratios (the box is shared and noisy).
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.kv_layout import KVLayout  # noqa: E402
from common.kv_transfer import KVTransferEngine, TransferConfig  # noqa: E402
from common.kv_transfer.p2p_group import PairGroup, host_store  # noqa: E402

MB = 1 << 20
BLOCK_BYTES = 64 * 1024  # one block of one layer: 2 x 16 tokens x 8 heads x 128 dims x fp16


def layout(num_layers: int) -> KVLayout:
    return KVLayout(num_layers=num_layers, num_kv_heads=8, head_dim=128, block_size=16, dtype="float16")


def case_blocks(num_layers: int, layer_bytes: int, paged: bool) -> tuple[int, list[int], list[int]]:
    """(cache blocks, producer block ids, consumer block ids): a contiguous run or shuffled pages."""
    n = layer_bytes // BLOCK_BYTES
    if not paged:
        return n, list(range(n)), list(range(n))
    g = torch.Generator().manual_seed(0)
    total = 2 * n
    return total, torch.randperm(total, generator=g)[:n].tolist(), torch.randperm(total, generator=g)[:n].tolist()


def tensor_view(t: torch.Tensor) -> memoryview:
    return memoryview((ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr()))


# ---- child: the prefill side ------------------------------------------------------------
def child_main(conn, tcp_port: int, coalesce_bytes: int) -> None:
    tcp = socket.create_connection(("127.0.0.1", tcp_port))
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    engines: dict[int, tuple[KVTransferEngine, list[torch.Tensor]]] = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "tcp":
            nbytes, chunks, reps = args
            payload = torch.ones(nbytes // chunks, dtype=torch.uint8)
            view = tensor_view(payload)
            for _ in range(reps):
                tcp.recv(1)
                for _ in range(chunks):
                    tcp.sendall(view)
            conn.send("ok")
        elif cmd == "pair":
            port, nbytes, reps = args
            pair = PairGroup("gloo", 1, "127.0.0.1", port, 30)
            t = torch.ones(nbytes, dtype=torch.uint8)
            for _ in range(reps):
                pair.send(t)
            pair.close()
            conn.send("ok")
        elif cmd == "engine":
            num_layers, num_blocks = args
            eng = KVTransferEngine("127.0.0.1:0", layout(num_layers),
                                   TransferConfig(timeout_s=30, coalesce_bytes=coalesce_bytes))
            kv = [torch.ones(layout(num_layers).layer_shape(num_blocks), dtype=torch.float16)
                  for _ in range(num_layers)]
            engines[num_layers * 10_000 + num_blocks] = (eng, kv)
            conn.send(eng.address)
        elif cmd == "finish":
            key, rid, block_ids, num_tokens = args
            eng, kv = engines[key]
            eng.producer.finish(rid, 1, kv, block_ids, num_tokens)
            eng.producer.poll_freeable()
            conn.send("ok")
        elif cmd == "stop":
            for eng, _ in engines.values():
                eng.close()
            tcp.close()
            conn.send("ok")
            return


# ---- parent: the decode side -----------------------------------------------------------
class Bench:
    def __init__(self, coalesce_bytes: int = TransferConfig.coalesce_bytes) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=child_main, args=(child, self.listener.getsockname()[1], coalesce_bytes), daemon=True)
        self.proc.start()
        self.tcp, _ = self.listener.accept()
        self.engines: dict[int, tuple[KVTransferEngine, str]] = {}
        self.seq = 0

    def call(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def tcp_gbps(self, nbytes: int, chunks: int, reps: int) -> float:
        buf = torch.empty(nbytes, dtype=torch.uint8)
        view = tensor_view(buf)
        self.conn.send(("tcp", nbytes, chunks, reps + 1))
        times = []
        for _ in range(reps + 1):  # the first one warms the buffers up (page faults)
            t0 = time.perf_counter()
            self.tcp.sendall(b"g")
            got = 0
            while got < nbytes:
                got += self.tcp.recv_into(view[got:], nbytes - got)
            times.append(time.perf_counter() - t0)
        assert self.conn.recv() == "ok"
        return nbytes / statistics.median(times[1:]) / 1e9

    def pair_gbps(self, nbytes: int, reps: int) -> float:
        store = host_store("127.0.0.1", 30)
        self.conn.send(("pair", store.port, nbytes, reps + 1))
        pair = PairGroup("gloo", 0, "127.0.0.1", store.port, 30, store=store)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            pair.recv_into(buf)
            times.append(time.perf_counter() - t0)
        pair.close()
        assert self.conn.recv() == "ok"
        return nbytes / statistics.median(times[1:]) / 1e9

    def engine_gbps(self, num_layers: int, layer_bytes: int, paged: bool, reps: int) -> float:
        num_blocks, p_ids, d_ids = case_blocks(num_layers, layer_bytes, paged)
        key = num_layers * 10_000 + num_blocks
        kvl = layout(num_layers)
        if key not in self.engines:
            address = self.call("engine", num_layers, num_blocks)
            self.engines[key] = (KVTransferEngine("127.0.0.1:0", kvl, TransferConfig(timeout_s=30)), address)
        eng, address = self.engines[key]
        kv = [torch.zeros(kvl.layer_shape(num_blocks), dtype=torch.float16) for _ in range(num_layers)]
        num_tokens = len(p_ids) * kvl.block_size
        times = []
        for _ in range(reps + 1):  # the first one also builds the pair
            self.seq += 1
            rid = f"b{self.seq}"
            self.call("finish", key, rid, p_ids, num_tokens)
            t0 = time.perf_counter()
            eng.consumer.request(rid, address, d_ids, num_tokens, kv)
            while True:
                done, failed = eng.consumer.poll_finished()
                if done or failed:
                    break
                time.sleep(0.0002)
            times.append(time.perf_counter() - t0)
            assert not failed, failed
        assert kv[0][:, d_ids].eq(1).all()
        return num_layers * layer_bytes / statistics.median(times[1:]) / 1e9

    @staticmethod
    def copy_gbps(nbytes: int, reps: int) -> float:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        return nbytes * reps / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        for eng, _ in self.engines.values():
            eng.close()
        self.call("stop")
        self.proc.join(10)
        self.tcp.close()
        self.listener.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--coalesce-mb", type=int, default=TransferConfig.coalesce_bytes // MB,
                        help="TransferConfig.coalesce_bytes of the producer, in MB")
    args = parser.parse_args()
    b = Bench(args.coalesce_mb * MB)
    rows: dict[str, dict[str, list[float]]] = {}
    reps = {1: 20, 16: 6, 128: 2}
    try:
        for _ in range(args.repeats):
            for size, n in reps.items():
                r = rows.setdefault(f"{size} MB", {"engine": [], "pair": [], "tcp": [], "copy": [], "ratio": []})
                r["engine"].append(b.engine_gbps(1, size * MB, paged=False, reps=n))
                r["pair"].append(b.pair_gbps(size * MB, n))
                r["tcp"].append(b.tcp_gbps(size * MB, 1, n))
                r["copy"].append(b.copy_gbps(size * MB, n))
                r["ratio"].append(r["engine"][-1] / r["tcp"][-1])
            r = rows.setdefault("32 layers x 2 MB, paged", {"engine": [], "pair": [], "tcp": [], "copy": [], "ratio": []})
            r["engine"].append(b.engine_gbps(32, 2 * MB, paged=True, reps=3))
            r["pair"].append(b.pair_gbps(2 * MB, 32))
            r["tcp"].append(b.tcp_gbps(64 * MB, 32, 3))  # 32 sendall()s of 2 MB into one buffer
            r["copy"].append(b.copy_gbps(64 * MB, 3))
            r["ratio"].append(r["engine"][-1] / r["tcp"][-1])
    finally:
        b.close()
    print(f"median of {args.repeats} repeats, GB/s (1 GB = 1e9 bytes), one way over loopback\n")
    print("| transfer | engine | pair | raw TCP | tensor copy | engine / TCP (median of per-repeat ratios) |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        print(f"| {name} | {med['engine']:.2f} | {med['pair']:.2f} | {med['tcp']:.2f} | {med['copy']:.2f} "
              f"| {med['ratio']:.2f} |")


if __name__ == "__main__":
    main()
