"""Where one small KV transfer's time goes: a timeline of a tcp transfer, step by step.

    python bench/kv_fixed_cost.py [--transfers 80] [--blocks 1] [--layers 1]
    python bench/kv_fixed_cost.py --transport cuda_ipc [--layers 32 --blocks 125]   (one GPU)

The same two processes as bench/kv_transfer.py (a child plays the prefill node, this process the
decode node; the child's producer has already finished the request, so the transfer is all that
is timed). Each step of the path is wrapped to stamp the monotonic clock (one clock for both
processes) on entry (``>``) and exit (``<``); the table gives each stamp's median offset from the
decode engine's ``request`` call over ``--transfers`` transfers (the first 10 are warm-up), and
the step it closes. ``raw TCP`` is the same bytes as one ``sendall`` after a one-byte request.
The wrappers cost about a microsecond each: the total is a little above bench/kv_transfer.py's.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import kv_transfer as kvb  # noqa: E402

STAMPS: list[tuple[str, int]] = []
# (class path, method, label, what the step ending at its entry stamp was)
STEPS = [
    ("consumer.KVConsumer", "request", "D engine: request", ""),
    ("receiver.PairReceiver", "new", "D I/O: new transfer", "engine thread -> I/O thread"),
    ("tcp_pair.TcpPair", "send_message", "D I/O: PULL on the socket", "record, pair check"),
    ("sender.PairSender", "_readable", "P I/O: PULL readable", "loopback + I/O thread wakes"),
    ("producer.KVProducer", "handle", "P I/O: PULL handled", "frame + msgpack decode"),
    ("sender.PairSender", "_run_job", "P I/O: send job", "table, lease, job queued"),
    ("sender.PairSender", "_write", "P I/O: bytes out", "job dispatch, views"),
    ("receiver.PairReceiver", "_readable", "D I/O: bytes readable", "loopback + I/O thread wakes"),
    ("receiver.PairReceiver", "_on_kv", "D I/O: header read, views", "frame header"),
    ("receiver.PairReceiver", "_finish", "D I/O: DONE read", "checks, blocks landed, next frame"),
    ("consumer.KVConsumer", "landed", "D I/O: DONE checked", "identity, checksums"),
]
# cuda_ipc: the control messages go over ZMQ, the producer copies into the consumer's blocks
IPC_STEPS = STEPS[:2] + [
    ("receiver.PairReceiver", "_pull", "D I/O: PULL out", "record, pair check"),
    ("producer.KVProducer", "handle", "P I/O: a message handled", "ZMQ + I/O thread wakes"),
    ("sender.PairSender", "_run_job", "P I/O: job", "table, lease, jobs queued"),
    ("cuda_ipc.IpcPair", "write", "P I/O: copies queued", "notice out"),
    ("cuda_ipc.IpcPair", "synchronize", "P waiter: synchronize", "waiter thread wakes"),
    ("sender.PairSender", "_done_out", "P I/O: DONE out", "copies done, waiter -> I/O thread"),
    ("receiver.PairReceiver", "_finish", "D I/O: DONE read", "ZMQ + I/O thread wakes"),
    STEPS[-1],
]


def stamp(label: str) -> None:
    STAMPS.append((label, time.perf_counter_ns()))


def wrap(owner, method: str, label: str) -> None:
    inner = getattr(owner, method)

    @functools.wraps(inner)
    def stamped(*args, **kwargs):
        stamp(label + " >")
        try:
            return inner(*args, **kwargs)
        finally:
            stamp(label + " <")

    setattr(owner, method, stamped)


def instrument(steps: list[tuple[str, str, str, str]]) -> None:
    import importlib

    for path, method, label, _ in steps:
        module, cls = path.split(".")
        wrap(getattr(importlib.import_module(f"common.kv_transfer.{module}"), cls), method, label)
    consumer = importlib.import_module("common.kv_transfer.consumer").KVConsumer
    poll = consumer.poll_finished

    def polled(self):
        out = poll(self)
        if out[0] or out[1]:
            stamp("D engine: woken, polled it >")
        return out

    consumer.poll_finished = polled


def child(*args) -> None:
    """The prefill side, instrumented; its stamps go to a file the parent reads."""
    instrument(IPC_STEPS if os.environ.get("PDSERVE_BENCH_TRANSPORT") == "cuda_ipc" else STEPS)
    try:
        kvb.child_main(*args)
    finally:
        Path(CHILD_STAMPS).write_text(json.dumps(STAMPS))


CHILD_STAMPS = str(Path(tempfile.gettempdir()) / "pdserve_kv_fixed_cost_child.json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--transfers", type=int, default=80)
    parser.add_argument("--blocks", type=int, default=1, help="64 KB blocks of each layer per transfer")
    parser.add_argument("--layers", type=int, default=1, help="layers per transfer")
    parser.add_argument("--transport", choices=("tcp", "cuda_ipc"), default="tcp",
                        help="cuda_ipc: both KV caches on cuda:0 (needs a GPU)")
    parser.add_argument("--cold", action="store_true",
                        help="a raw TCP transfer of the same bytes before each one, as bench/kv_transfer.py "
                             "interleaves them (caches cold, as after a forward pass)")
    args = parser.parse_args()
    ipc = args.transport == "cuda_ipc"
    if ipc and not torch.cuda.is_available():
        print("CUDA is not available: --transport cuda_ipc needs a GPU; nothing measured.")
        return
    os.environ["PDSERVE_BENCH_TRANSPORT"] = args.transport  # the child (spawned) reads it
    steps = IPC_STEPS if ipc else STEPS
    kvb.child_main = child
    instrument(steps)
    b = kvb.Bench(device="cuda" if ipc else "cpu")
    layer_bytes = args.blocks * kvb.BLOCK_BYTES
    nbytes = layer_bytes * args.layers
    try:
        totals, raw = [], []
        for _ in range(args.transfers):
            if args.cold:
                raw.append(b.tcp_seconds(nbytes, 1))
            totals.append(b.engine_seconds(args.transport, args.layers, layer_bytes, False))
        raw = (raw or [b.tcp_seconds(nbytes, 1) for _ in range(args.transfers)])[10:]
        totals = totals[10:]
    finally:
        b.close()
    stamps = sorted(STAMPS + [tuple(s) for s in json.loads(Path(CHILD_STAMPS).read_text())], key=lambda s: s[1])
    runs: list[list[tuple[str, int]]] = []
    for label, t in stamps:
        if label == "D engine: request >":
            runs.append([])
        if runs:
            runs[-1].append((label, t))
    offsets: dict[str, list[float]] = collections.defaultdict(list)
    for run in runs[10:]:
        seen: set[str] = set()
        for label, t in run:
            if label not in seen:  # a step's first entry and exit in this transfer
                seen.add(label)
                offsets[label].append((t - run[0][1]) / 1000)
    why = {label + " >": step for _, _, label, step in steps if step}
    print(f"{len(totals)} transfers of {nbytes // 1024} KB ({args.layers} layers), {args.transport}, medians; "
          "offsets from the decode engine's request\n")
    print("| stamp | µs from request | step ending here |")
    print("|---|---|---|")
    previous = 0.0
    for label, values in sorted(offsets.items(), key=lambda kv: statistics.median(kv[1])):
        if not label.endswith(">") or len(values) < len(runs[10:]) // 2:
            continue
        at = statistics.median(values)
        print(f"| {label[:-2]} | {at:.0f} | {why.get(label, '')} (+{at - previous:.0f}) |")
        previous = at
    print(f"\nwhole transfer (uninstrumented clock in the bench): {statistics.median(totals) * 1e6:.0f} µs; "
          f"raw TCP, same bytes: {statistics.median(raw) * 1e6:.0f} µs")


if __name__ == "__main__":
    main()
