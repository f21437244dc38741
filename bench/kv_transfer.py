"""KV transfer bandwidth: our engine vs raw TCP vs a plain tensor copy, in one run.

    python bench/kv_transfer.py [--repeats 3] [--transports tcp,gloo]

A child process plays the prefill side (our producer engines and a raw TCP sender); this
process plays the decode side. "engine (T)" times a whole transfer over transport T as
the decode daemon sees it: ``consumer.request`` -> PULL -> bytes (tcp: each message behind
an in-band header; gloo: behind a control-plane notice), from and into paged blocks -> DONE -> the
waiting thread woken by the engine's ``on_progress``, as the decode daemon's engine thread is.
"gloo pair" is torch's gloo pair alone, one message of the row's size (2 MB messages for
the paged row). "raw TCP" is sendall/recv_into into a warmed buffer, after a one-byte
request (32 back-to-back 2 MB sends for the paged row, all from one cache-hot 2 MB buffer;
"own bytes" sends 64 MB from memory instead, as the engine must).

Each repeat runs a few rounds per row; a round is a raw TCP transfer and then each
engine's, back to back, and gives one ratio (raw time / engine time) per engine. The
table shows medians over every round of every repeat: the box is shared and noisy, and a
ratio of neighbouring transfers cancels most of a neighbour's load.
"""

from __future__ import annotations

import argparse
import ctypes
import multiprocessing as mp
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.kv_layout import KVLayout  # noqa: E402
from common.kv_transfer import KVEndpoint, TransferConfig  # noqa: E402
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
    p_ids = torch.randperm(total, generator=g)[:n].tolist()
    return total, p_ids, torch.randperm(total, generator=g)[:n].tolist()


def tensor_view(t: torch.Tensor) -> memoryview:
    return memoryview((ctypes.c_ubyte * (t.numel() * t.element_size())).from_address(t.data_ptr()))


# ---- child: the prefill side ------------------------------------------------------------
def child_main(conn, tcp_port: int, coalesce_bytes: int) -> None:
    tcp = socket.create_connection(("127.0.0.1", tcp_port))
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    engines: dict[int, tuple[KVEndpoint, list[torch.Tensor]]] = {}
    payloads: dict[int, torch.Tensor] = {}
    while True:
        cmd, *args = conn.recv()
        if cmd == "tcp":
            nbytes, chunks, reps, distinct = args
            chunk = nbytes // chunks
            size = nbytes if distinct else chunk
            view = tensor_view(payloads.setdefault(size, torch.ones(size, dtype=torch.uint8)))
            conn.send("ready")  # the parent's clock starts after this
            for _ in range(reps):
                tcp.recv(1)
                for i in range(chunks):
                    tcp.sendall(view[i * chunk:(i + 1) * chunk] if distinct else view)
            conn.send("ok")
        elif cmd == "pair":
            port, nbytes, reps = args
            pair = PairGroup("gloo", 1, "127.0.0.1", port, 30)
            t = torch.ones(nbytes, dtype=torch.uint8)
            for _ in range(reps):
                pair.send([t])
            pair.close()
            conn.send("ok")
        elif cmd == "engine":
            key, num_layers, num_blocks, transport, device = args
            eng = KVEndpoint("127.0.0.1:0", layout(num_layers),
                                   TransferConfig(timeout_s=30, coalesce_bytes=coalesce_bytes),
                                   transport=transport, device=device)
            kv = [torch.ones(layout(num_layers).layer_shape(num_blocks), dtype=torch.float16, device=device)
                  for _ in range(num_layers)]
            engines[key] = (eng, kv)
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
    def __init__(self, coalesce_bytes: int = TransferConfig.coalesce_bytes, device: str = "cpu") -> None:
        self.device = device  # the KV caches' (cuda: for a cuda_ipc pair on one GPU)
        self.listener = socket.create_server(("127.0.0.1", 0))
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (child, self.listener.getsockname()[1], coalesce_bytes)
        self.proc = ctx.Process(target=child_main, args=args, daemon=True)
        self.proc.start()
        self.tcp, _ = self.listener.accept()
        self.engines: dict[tuple, tuple[KVEndpoint, str, list[torch.Tensor]]] = {}
        self.buffers: dict[int, torch.Tensor] = {}
        self.seq = 0
        self.progress = threading.Event()  # set by the consumer when a transfer ends, as a daemon's wake-up

    def call(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def tcp_seconds(self, nbytes: int, chunks: int, distinct: bool = True) -> float:
        """One transfer: ``chunks`` sendall()s into one warm buffer, each from its own part of
        an ``nbytes`` payload (``distinct``) or all from one cache-hot chunk."""
        buf = self.buffers.setdefault(nbytes, torch.zeros(nbytes, dtype=torch.uint8))  # zeros: faulted in
        view = tensor_view(buf)
        assert self.call("tcp", nbytes, chunks, 1, distinct) == "ready"
        t0 = time.perf_counter()
        self.tcp.sendall(b"g")
        got = 0
        while got < nbytes:
            got += self.tcp.recv_into(view[got:], nbytes - got)
        seconds = time.perf_counter() - t0
        assert self.conn.recv() == "ok"
        return seconds

    def pair_gbps(self, nbytes: int, reps: int) -> float:
        store = host_store("127.0.0.1", 30)
        self.conn.send(("pair", store.port, nbytes, reps + 1))
        pair = PairGroup("gloo", 0, "127.0.0.1", store.port, 30, store=store)
        buf = torch.empty(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            pair.recv_into([buf])
            times.append(time.perf_counter() - t0)
        pair.close()
        assert self.conn.recv() == "ok"
        return nbytes / statistics.median(times[1:]) / 1e9

    def engine_seconds(self, transport: str, num_layers: int, layer_bytes: int, paged: bool) -> float:
        """One whole transfer as the decode side sees it (the first one per case also builds the pair)."""
        num_blocks, p_ids, d_ids = case_blocks(num_layers, layer_bytes, paged)
        key = (transport, num_layers, num_blocks)
        kvl = layout(num_layers)
        if key not in self.engines:
            address = self.call("engine", key, num_layers, num_blocks, transport, self.device)
            eng = KVEndpoint("127.0.0.1:0", kvl, TransferConfig(timeout_s=30), transport=transport,
                                   on_progress=self.progress.set, device=self.device)
            kv = [torch.zeros(kvl.layer_shape(num_blocks), dtype=torch.float16, device=self.device)
                  for _ in range(num_layers)]
            self.engines[key] = (eng, address, kv)
        eng, address, kv = self.engines[key]
        self.seq += 1
        rid = f"b{self.seq}"
        self.call("finish", key, rid, p_ids, len(p_ids) * kvl.block_size)
        kv[0][:, d_ids] = 0
        self.progress.clear()
        t0 = time.perf_counter()
        eng.consumer.request(rid, address, d_ids, len(p_ids) * kvl.block_size, kv)
        while True:
            done, failed = eng.consumer.poll_finished()
            if done or failed:
                break
            self.progress.wait(1.0)
            self.progress.clear()
        seconds = time.perf_counter() - t0
        assert not failed, failed
        assert kv[0][:, d_ids].eq(1).all()
        return seconds

    @staticmethod
    def copy_gbps(nbytes: int, reps: int) -> float:
        src, dst = torch.ones(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        dst.copy_(src)
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        return nbytes * reps / (time.perf_counter() - t0) / 1e9

    def close(self) -> None:
        for eng, _, _ in self.engines.values():
            eng.close()
        self.call("stop")
        self.proc.join(10)
        self.tcp.close()
        self.listener.close()


def run_case(b: Bench, case: tuple, transports: list[str], rounds: int, r: dict[str, list[float]]) -> None:
    """``rounds`` back-to-back rounds of: raw TCP, raw TCP from own bytes, each engine transport.
    Each round's ratios compare transfers a few milliseconds apart, so a neighbour's load spike
    hits both sides of a ratio or neither."""
    _, layers, layer_bytes, paged, total, chunks = case
    for _ in range(rounds):
        raw = b.tcp_seconds(total, chunks, distinct=False)
        own = b.tcp_seconds(total, chunks, distinct=True) if chunks > 1 else raw
        r.setdefault("raw", []).append(total / raw / 1e9)
        r.setdefault("own", []).append(total / own / 1e9)
        for t in transports:
            seconds = b.engine_seconds(t, layers, layer_bytes, paged)
            r.setdefault(t, []).append(total / seconds / 1e9)
            r.setdefault(f"{t} ratio", []).append(raw / seconds)
            r.setdefault(f"{t} own", []).append(own / seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--transports", default="tcp,gloo", help="engine transports to time, comma-separated")
    parser.add_argument("--coalesce-mb", type=int, default=TransferConfig.coalesce_bytes // MB,
                        help="TransferConfig.coalesce_bytes of the producer, in MB")
    args = parser.parse_args()
    transports = args.transports.split(",")
    b = Bench(args.coalesce_mb * MB)
    # (name, layers, layer bytes, paged, raw TCP bytes, raw TCP sendall()s, rounds per repeat);
    # the paged row: 32 layers of 2 MB in shuffled blocks against 32 sendall()s of 2 MB
    cases = [(f"{size} MB", 1, size * MB, False, size * MB, 1, n) for size, n in ((1, 20), (16, 6), (128, 2))]
    cases.append(("32 layers x 2 MB, paged", 32, 2 * MB, True, 64 * MB, 32, 3))
    rows: dict[str, dict[str, list[float]]] = {case[0]: {} for case in cases}
    try:
        for case in cases:  # warm-up: page faults, pair builds
            run_case(b, case[:-1], transports, 1, {})
        for _ in range(args.repeats):
            for case in cases:
                r, n = rows[case[0]], case[-1]
                run_case(b, case[:-1], transports, n, r)
                r.setdefault("pair", []).append(b.pair_gbps(case[2], 32 if case[3] else n))
                r.setdefault("copy", []).append(b.copy_gbps(case[4], n))
    finally:
        b.close()
    print(f"{args.repeats} repeats; GB/s (1 GB = 1e9 bytes), one way over loopback, medians; "
          "ratios: median over rounds of raw TCP time / engine time, each round back to back\n")
    heads = [f"engine ({t})" for t in transports] + ["gloo pair", "raw TCP", "raw TCP, own bytes"] \
        + ["tensor copy"] + [f"{t} / TCP" for t in transports] + [f"{t} / TCP own bytes" for t in transports]
    print("| transfer | " + " | ".join(heads) + " |")
    print("|---" * (len(heads) + 1) + "|")
    for name, r in rows.items():
        med = {k: statistics.median(v) for k, v in r.items()}
        cells = [med[t] for t in transports] + [med["pair"], med["raw"], med["own"], med["copy"]] + \
            [med[f"{t} ratio"] for t in transports] + [med[f"{t} own"] for t in transports]
        print(f"| {name} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
