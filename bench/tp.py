"""Tensor parallelism on one node: what each rank holds and what TP costs, TP 1 against TP N.

For each size in ``--sizes``, one ``pdserve serve --tensor-parallel-size N`` (real processes:
rank 0 and N - 1 workers) on the embedded model, or ``--model DIR``. Printed per size:
- per rank, the bytes of the weights it loaded: each rank's shard is loaded here with the
  engine's own loader (``TPShard(rank, N)``) and its parameters summed. A shared tied table is
  counted once. The target is 1/N of the whole, plus what every rank keeps whole (norms,
  biases of row-parallel layers);
- per rank, the peak resident memory of its process (``VmHWM``): torch's own runtime (a few
  hundred MiB) plus the shard and the KV cache;
- TTFT p50 of ``--requests`` streamed requests of a 512-token prompt, one at a time, and the
  decode rate (tokens/s) of a 64-token answer.

KV transfer between prefill and decode nodes of different TP sizes is not built (prefill and
decode daemons refuse N > 1), so the per-pairing rows of issue 20 (KV bytes per rank, transfer
time) are not printed.

    python bench/tp.py [--sizes 1,2] [--requests 5] [--model DIR] [--device cpu]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from common.model.embedded import ensure_embedded_model  # noqa: E402
from common.model.loader import load_model  # noqa: E402
from common.model.tensor_parallel import TPShard  # noqa: E402
from helpers.cluster import start  # noqa: E402
from helpers.procs import children  # noqa: E402
from helpers.stats import pct  # noqa: E402

MiB = 2**20


def shard_bytes(model_dir: Path, rank: int, size: int) -> int:
    """The bytes of rank ``rank``'s weights at TP ``size`` (float32, as on CPU)."""
    model, _ = load_model(model_dir, "cpu", tp=TPShard(rank, size))
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def timings(url: str, model: str, requests: int) -> tuple[float, float]:
    """TTFT p50 (ms) of a 512-token prompt, and the decode tokens/s of a 64-token answer."""
    ttfts, rates = [], []
    for i in range(requests):
        prompt = [(7 * i + 13 * j) % 250 + 3 for j in range(512)]  # fresh tokens: no cache hit
        body = {"model": model, "prompt": prompt, "max_tokens": 64, "temperature": 0, "ignore_eos": True,
                "stream": True}
        t0 = time.perf_counter()
        times = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
            for line in r.iter_lines():
                if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                    times.append(time.perf_counter())
        ttfts.append((times[0] - t0) * 1000)
        rates.append((len(times) - 1) / (times[-1] - times[0]))
    return pct(ttfts, 0.5), pct(rates, 0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--model", default=None, help="a Hugging Face directory (default: the embedded model)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else ensure_embedded_model()
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-tp-"))
    rows = []
    for size in [int(s) for s in args.sizes.split(",")]:
        weights = [shard_bytes(model_dir, r, size) for r in range(size)]
        extra = ("--model", str(model_dir)) if args.model else ()
        node = start("both", tmp, "--tensor-parallel-size", str(size), "--device", args.device, *extra,
                     name=f"tp{size}")
        try:
            name = httpx.get(node.url + "/v1/models", timeout=10).json()["data"][0]["id"]
            ttft, rate = timings(node.url, name, args.requests)
            pids = [node.popen.pid] + children(node.popen.pid)
            rss = [peak_rss(pid) for pid in pids]
        finally:
            node.stop()
        for rank in range(size):
            rows.append((size, rank, weights[rank], rss[rank] if rank < len(rss) else 0, ttft, rate))
        print(f"TP {size} done", file=sys.stderr)
    whole = rows[0][2]
    print(f"\n{model_dir.name}, {args.device}; TTFT: 512-token prompt, p50 of {args.requests}; decode: 64 tokens\n")
    print("| TP | rank | weights | share of TP 1's | peak RSS | TTFT p50 | decode tok/s |")
    print("|---|---|---|---|---|---|---|")
    for size, rank, w, rss, ttft, rate in rows:
        print(f"| {size} | {rank} | {w / MiB:.1f} MiB | {w / whole:.2f} | {rss / MiB:.0f} MiB | {ttft:.1f} ms | "
              f"{rate:.1f} |")


if __name__ == "__main__":
    main()
