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

Then, for each pairing ``P-D`` in ``--pairings`` (prefill TP P, decode TP D), a proxy, a
``pdserve prefill`` of TP P and a ``pdserve decode`` of TP D (``--no-enable-prefix-caching``, so
every request pulls its KV) registered with it. How the ranks pair (``common/kv_transfer/``):
- P = D: decode rank r pulls its own KV heads from prefill rank r (``tp_ranks.py``);
- P = k x D: decode rank d pulls k whole prefill ranks, each into a slice of its own heads
  (``tp_routes.py``);
- P < D (D = k x P): the prefill node starts with ``--kv-ranks D``: each of its ranks cuts its
  heads into k slices, each a KV endpoint of its own at kv-port + v (``tp_slices.py``), and decode
  rank r pulls KV rank r.
Either way a request moves max(P, D) pairs' worth of KV. One warm-up request, then
``--requests`` streamed requests through the proxy, one at a time, each a fresh ~1,000-token
prompt and 8 tokens out. Printed per pairing and rank (rows for max(P, D) ranks; a side with
fewer ranks shows ``-``), against the 1-1 row:
- ``P KV ranks``: the prefill node's KV endpoints (``--kv-ranks``, or P when not given);
- the KV bytes the rank moved per request: the deltas of
  ``pdserve:kv_rank_transfer_bytes_total{role,rank}``, prefill (sent) and decode (received).
  On a prefill node with ``--kv-ranks``, all the KV ranks of one TP rank count under that TP
  rank (a TP-1 prefill's under rank 0); on a decode node, each rank its own received bytes;
- the transfer time per request: the decode rank's ``pdserve:kv_rank_transfer_seconds_total``
  delta / requests (summed over the rank's pairs, when it pulls more than one), and the mean of
  decode's ``pdserve:kv_transfer_seconds`` histogram: one observation per finished transfer
  (pair) of decode rank 0. Decode times a transfer from its PULL to DONE, so it includes the
  prefill node computing the prompt (layers travel while P computes);
- pairs / request: the KV transfers one request takes. The histogram counts decode rank 0's
  transfers only (the workers' are not exported as a count), so this is its count delta /
  requests x D: every decode rank pulls as many pairs as rank 0 (the per-rank bytes show it).
  The proxy runs ``--disagg-policy always`` (``auto`` may let the decode node prefill a prompt
  itself), so it should be max(P, D);
- TTFT p50 and max, measured by the client through the proxy.

A pairing where neither size divides the other cannot pair (the proxy refuses it): it is
reported as not built, not run.

    python bench/tp.py [--sizes 1,2] [--pairings 1-1,2-2,2-1,1-2] [--requests 5] [--model DIR] [--device cpu]
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
from helpers.cluster import start, stop_all, wait_idle  # noqa: E402
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


PAIR_PROMPT = 1000  # tokens
NOT_BUILT = "not built: neither TP size divides the other"


def scrape(url: str) -> dict[tuple[str, str], float]:
    """Per-rank KV bytes and seconds, ``("bytes" | "seconds", rank)``, and the
    ``pdserve:kv_transfer_seconds`` histogram's ``("hist", "sum" | "count")``, from one scrape."""
    out: dict[tuple[str, str], float] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        value = line.rsplit(" ", 1)[-1]
        if line.startswith(("pdserve:kv_rank_transfer_bytes_total{", "pdserve:kv_rank_transfer_seconds_total{")):
            kind = "bytes" if "_bytes_" in line else "seconds"
            out[(kind, line.split('rank="', 1)[1].split('"', 1)[0])] = float(value)
        elif line.startswith(("pdserve:kv_transfer_seconds_sum{", "pdserve:kv_transfer_seconds_count{")):
            out[("hist", line.split("{", 1)[0].rsplit("_", 1)[1])] = float(value)
    return out


def delta(after: dict, before: dict) -> dict:
    return {k: v - before.get(k, 0.0) for k, v in after.items()}


def pairing(tmp: Path, p_tp: int, d_tp: int, requests: int, device: str, extra: tuple[str, ...]) -> dict:
    """One proxy + prefill (TP ``p_tp``) + decode (TP ``d_tp``): per-rank deltas and client TTFTs."""
    common = ("--device", device, "--heartbeat-interval-s", "0.5", *extra)
    procs = []
    try:
        # always: every request takes the prefill leg and a KV transfer (auto may prefill on D)
        proxy = start("proxy", tmp, "--disagg-policy", "always", name=f"proxy-{p_tp}-{d_tp}", wait=False)
        procs.append(proxy)
        reg = ("--proxy", f"127.0.0.1:{proxy.kv_port}")
        kv_ranks = ("--kv-ranks", str(d_tp)) if p_tp < d_tp else ()  # each prefill rank's heads in D / P slices
        prefill = start("prefill", tmp, "--tensor-parallel-size", str(p_tp), *kv_ranks, *reg, *common,
                        name=f"prefill-tp{p_tp}", wait=False)
        procs.append(prefill)
        decode = start("decode", tmp, "--tensor-parallel-size", str(d_tp), "--no-enable-prefix-caching", *reg,
                       *common, name=f"decode-tp{d_tp}", wait=False)
        procs.append(decode)
        for proc in (prefill, decode):
            proc.wait_ready()
        proxy.wait_ready(timeout=60)  # ready = a compatible P and D registered
        name = httpx.get(prefill.url + "/v1/models", timeout=10).json()["data"][0]["id"]

        def one(i: int) -> float:
            prompt = [(7 * i + 13 * j) % 2000 + 3 for j in range(PAIR_PROMPT)]  # fresh: nothing cached
            body = {"model": name, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
                    "stream": True}
            t0, ttft = time.perf_counter(), None
            with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=600) as r:
                r.raise_for_status()
                for line in r.iter_lines():  # the whole answer is read; the first text is the TTFT
                    if ttft is None and line.startswith("data: {") and any(
                            c.get("text") for c in json.loads(line[6:])["choices"]):
                        ttft = (time.perf_counter() - t0) * 1000
            if ttft is None:
                raise RuntimeError("no text came back through the proxy")
            return ttft

        one(10_000)  # warm-up, not counted
        for proc in (prefill, decode):
            wait_idle(proc.url)
        before = {"p": scrape(prefill.url), "d": scrape(decode.url)}
        ttfts = [one(i) for i in range(requests)]
        for proc in (prefill, decode):
            wait_idle(proc.url)
        return {"p": delta(scrape(prefill.url), before["p"]), "d": delta(scrape(decode.url), before["d"]),
                "ttfts": ttfts}
    finally:
        stop_all(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1,2")
    ap.add_argument("--pairings", default="1-1,2-2,2-1,1-2", help="P_TP-D_TP, comma-separated")
    ap.add_argument("--requests", type=int, default=5)
    ap.add_argument("--model", default=None, help="a Hugging Face directory (default: the embedded model)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    model_dir = Path(args.model) if args.model else ensure_embedded_model()
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-tp-"))
    extra_model = ("--model", str(model_dir)) if args.model else ()
    rows = []
    for size in [int(s) for s in args.sizes.split(",") if s]:
        weights = [shard_bytes(model_dir, r, size) for r in range(size)]
        node = start("both", tmp, "--tensor-parallel-size", str(size), "--device", args.device, *extra_model,
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
    if rows:
        whole = rows[0][2]
        print(f"\n{model_dir.name}, {args.device}; TTFT: 512-token prompt, p50 of {args.requests}; decode: 64 tokens\n")
        print("| TP | rank | weights | share of TP 1's | peak RSS | TTFT p50 | decode tok/s |")
        print("|---|---|---|---|---|---|---|")
        for size, rank, w, rss, ttft, rate in rows:
            print(f"| {size} | {rank} | {w / MiB:.1f} MiB | {w / whole:.2f} | {rss / MiB:.0f} MiB | {ttft:.1f} ms | "
                  f"{rate:.1f} |")

    pairs = [tuple(int(n) for n in p.split("-")) for p in args.pairings.split(",") if p]
    results = {}
    for p_tp, d_tp in pairs:
        if p_tp % d_tp and d_tp % p_tp:
            results[(p_tp, d_tp)] = None
            continue
        for attempt in range(3):
            try:
                results[(p_tp, d_tp)] = pairing(tmp, p_tp, d_tp, args.requests, args.device, extra_model)
                break
            except RuntimeError as e:
                # the helper's ports come from the ephemeral range: between its choice and the
                # bind, an outgoing connection may take kv-port + r. Start the pairing again.
                if "is in use" not in str(e) or attempt == 2:
                    raise
                print(f"pairing {p_tp}-{d_tp}: a port was taken before its bind; again", file=sys.stderr)
        print(f"pairing {p_tp}-{d_tp} done", file=sys.stderr)
    base = results.get((1, 1))
    n = args.requests
    print(f"\nP-D pairings, through the proxy: {PAIR_PROMPT}-token prompts (fresh each), 8 tokens out, "
          f"{n} requests one at a time; per request; ratio = this row / the 1-1 row (rank 0)\n")
    print("| P-D | P KV ranks | rank | pairs / request | P KV sent | D KV received | bytes vs 1-1 | "
          "D rank transfer | vs 1-1 | kv_transfer_seconds mean (D rank 0) | TTFT p50 | TTFT max | TTFT p50 vs 1-1 |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def ratio(value: float, ref: float | None) -> str:
        return f"{value / ref:.2f}x" if ref else "-"

    ref = None
    if base:
        ref = (base["d"].get(("bytes", "0"), 0) / n, base["d"].get(("seconds", "0"), 0) / n * 1000,
               pct(base["ttfts"], 0.5))
    for (p_tp, d_tp), res in results.items():
        if res is None:
            print(f"| {p_tp}-{d_tp} | - | - | {NOT_BUILT} | | | | | | | | | |")
            continue
        kv_ranks = f"{d_tp} (--kv-ranks {d_tp})" if p_tp < d_tp else str(p_tp)  # else one KV rank a TP rank
        count = res["d"].get(("hist", "count"), 0)  # decode rank 0's finished transfers (pairs)
        pairs = count / n * d_tp  # every decode rank pulls as many pairs as rank 0
        hist = res["d"].get(("hist", "sum"), 0) / max(count, 1) * 1000
        p50, worst = pct(res["ttfts"], 0.5), max(res["ttfts"])
        for rank in range(max(p_tp, d_tp)):
            r = str(rank)
            sent = f"{res['p'].get(('bytes', r), 0) / n / MiB:.2f} MiB" if rank < p_tp else "-"
            if rank < d_tp:
                got = res["d"].get(("bytes", r), 0) / n
                secs = res["d"].get(("seconds", r), 0) / n * 1000
                d_cols = (f"{got / MiB:.2f} MiB | {ratio(got, ref and ref[0])} | {secs:.1f} ms | "
                          f"{ratio(secs, ref and ref[1])}")
            else:
                d_cols = "- | - | - | -"
            print(f"| {p_tp}-{d_tp} | {kv_ranks} | {rank} | {pairs:g} | {sent} | {d_cols} | {hist:.1f} ms | "
                  f"{p50:.1f} ms | {worst:.1f} ms | {ratio(p50, ref and ref[2])} |")


if __name__ == "__main__":
    main()
