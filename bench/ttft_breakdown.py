"""Time to first token for a long prompt: disaggregated (prefill -> decode) vs colocated.

Starts a colocated node, a prefill daemon and a decode daemon (real processes; the embedded
model on CPU unless told otherwise; KV over the default data plane) and sends a 2,000-token
prompt, each path a fresh one, over one kept-alive HTTP client (as the proxy's legs are).
Breakdown for the prefill-first order:

- prefill compute: the prefill leg's latency (HTTP + tokenize + prefill + first token);
- transfer: the decode node's ``kv_transfer_seconds`` for the request (PULL to DONE);
- handoff: the rest of the decode leg's time to first token (HTTP, allocation,
  handshake, appending the first token, streaming it).

Also the concurrent order (both legs at once, the proxy's default) end to end, and each
disaggregated TTFT over the colocated one of the same round (median of those ratios).

With ``--itl`` it also measures the inter-token gaps of a request decoding on D while another
prompt's KV arrives there (issue 10: ITL unchanged while a 2,000-token prompt's KV lands).
On a GPU machine, ``--shape llama3.1-8b`` serves a random-weight checkpoint of that shape
(made on the GPU, as bench/gpu_engine.py does) and ``--node-arg`` passes each node its flags,
e.g. one GPU shared by the three nodes:

    python bench/ttft_breakdown.py [--prompt-tokens 2000] [--repeats 5] [--itl]
    python bench/ttft_breakdown.py --shape llama3.1-8b --itl --node-arg=--device=cuda \
        --node-arg=--gpu-memory-utilization=0.28 --node-arg=--kv-transport=cuda_ipc
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from common.request_id import make_request_id  # noqa: E402
from helpers.cluster import Proc, metric, start  # noqa: E402


# One client, connections kept alive, as the proxy's: a new httpx client per request costs
# 25-60 ms here (it loads the CA bundle), which the disaggregated path would pay twice.
HTTP = httpx.Client(timeout=120)


def token_times(url: str, body: dict, request_id: str | None, times: list[float]) -> None:
    """Stream one request to its end, appending perf_counter() of each token event to ``times``."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    with HTTP.stream("POST", url + "/v1/completions", json={**body, "stream": True}, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                times.append(time.perf_counter())


def first_token_s(url: str, body: dict, request_id: str | None = None) -> float:
    """Seconds from sending a streaming request to its first token event (read to the end:
    the request must finish before the next)."""
    times: list[float] = []
    t0 = time.perf_counter()
    token_times(url, body, request_id, times)
    if not times:
        raise RuntimeError("no token")
    return times[0] - t0


def prefill_leg_s(prefill: Proc, body: dict, rid: str) -> float:
    t0 = time.perf_counter()
    r = HTTP.post(prefill.url + "/v1/completions", json={**body, "max_tokens": 1, "stream": False},
                  headers={"X-Request-Id": rid}, timeout=120)
    r.raise_for_status()
    return time.perf_counter() - t0


def transfer_sum(decode: Proc) -> float:
    return metric(decode.url, "pdserve:kv_transfer_seconds_sum")


def transfer_bytes(decode: Proc) -> float:
    return metric(decode.url, "pdserve:kv_transfer_bytes_total")


def kv_megabytes(prompt_tokens: int) -> float:
    """The embedded model's KV for a prompt: 4 layers x K,V x 2 KV heads x head_dim 64, fp32."""
    return 4 * 2 * prompt_tokens * 2 * 64 * 4 / 1e6


PARTS = ("colocated", "prefill", "transfer", "handoff", "pf_total", "concurrent", "pf_ratio", "concurrent_ratio",
         "kv_mb", "transfer_gbps")


def pair_transport(decode: Proc) -> str:
    """The data plane the decode node's live pairs use (``kv_pairs{transport}``), e.g. "tcp"."""
    text = HTTP.get(decode.url + "/metrics", timeout=10).text
    live = re.findall(r'^pdserve:kv_pairs\{[^}]*transport="([^"]+)"[^}]*\} ([0-9.]+)', text, re.M)
    return ", ".join(sorted({t for t, n in live if float(n) > 0})) or "none"


def fresh_prompt(prompt_tokens: int, rng: random.Random) -> dict:
    """A random prompt: no node's prefix cache holds it, so every token is computed and moved."""
    return {"prompt": [rng.randrange(4, 2048) for _ in range(prompt_tokens)], "max_tokens": 2,
            "temperature": 0, "ignore_eos": True}


def sample(both: Proc, prefill: Proc, decode: Proc, prompt_tokens: int,
           rng: random.Random) -> dict[str, float]:
    """One round: ms of each part in ``PARTS``, each path on a prompt no node has seen."""
    body = fresh_prompt(prompt_tokens, rng)
    colocated = first_token_s(both.url, body)
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)
    p = prefill_leg_s(prefill, body, rid)
    before, before_bytes = transfer_sum(decode), transfer_bytes(decode)
    d = first_token_s(decode.url, body, rid)
    transfer = transfer_sum(decode) - before
    moved = transfer_bytes(decode) - before_bytes
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)
    body = fresh_prompt(prompt_tokens, rng)  # the legs above left this prompt in both caches
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        leg = pool.submit(prefill_leg_s, prefill, body, rid)
        first_token_s(decode.url, body, rid)
        concurrent = time.perf_counter() - t0
        leg.result()
    values = (colocated, p, transfer, d - transfer, p + d, concurrent)
    ms = {key: value * 1000 for key, value in zip(PARTS, values)}
    # ratios within the round: its paths ran seconds apart, so the box's load swings (+-50 ms on
    # a prefill here) mostly cancel, where a ratio of medians would not
    return {**ms, "pf_ratio": (p + d) / colocated, "concurrent_ratio": concurrent / colocated,
            "kv_mb": moved / 1e6, "transfer_gbps": moved / transfer / 1e9 if transfer > 0 else 0.0}


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in PARTS}


def measure(both: Proc, prefill: Proc, decode: Proc, prompt_tokens: int, repeats: int,
            rng: random.Random) -> dict[str, float]:
    """Median ms of each part in ``PARTS`` over ``repeats`` rounds (after a warm-up round)."""
    sample(both, prefill, decode, prompt_tokens, rng)  # warms up every process
    return medians([sample(both, prefill, decode, prompt_tokens, rng) for _ in range(repeats)])


def itl_sample(prefill: Proc, decode: Proc, prompt_tokens: int, stream_tokens: int,
               rng: random.Random) -> dict[str, float]:
    """Inter-token gaps (ms) of a request decoding on D, before and while another prompt's KV
    arrives on D. The second prompt is prefilled first (its KV waits on P), so the window holds
    D's intake, the transfer and the landing, not P's compute on a shared machine."""
    short = {"prompt": [rng.randrange(4, 2048) for _ in range(16)], "max_tokens": stream_tokens,
             "temperature": 0, "ignore_eos": True}
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)
    prefill_leg_s(prefill, short, rid)
    body = fresh_prompt(prompt_tokens, rng)
    rid2 = make_request_id(prefill.kv_addr, decode.kv_addr)
    prefill_leg_s(prefill, body, rid2)  # KV held on P until D asks
    times: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(token_times, decode.url, short, rid, times)
        deadline = time.monotonic() + 120
        while len(times) < 32 and not running.done() and time.monotonic() < deadline:  # steady decoding
            time.sleep(0.001)
        window_start = time.perf_counter()
        arrival = first_token_s(decode.url, body, rid2)
        window_end = window_start + arrival
        running.result()
    gaps = [(b - a, b) for a, b in zip(times, times[1:])]
    before = [g for g, t in gaps if t < window_start]
    # during: gaps that end in the window or within the longest earlier gap after it (the step it delayed)
    during = [g for g, t in gaps if window_start <= t <= window_end + max(before, default=0)]
    return {"itl_before": 1000 * statistics.median(before) if before else 0.0,
            "itl_during_max": 1000 * max(during, default=0.0),
            "itl_during_p50": 1000 * statistics.median(during) if during else 0.0,
            "arrival": 1000 * arrival}


def run(prompt_tokens: int, repeats: int, node_args: list[str], model: str, itl: bool) -> None:
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-ttft-"))
    procs = []
    try:
        procs = [start(role, tmp, *node_args) for role in ("both", "prefill", "decode")]
        med = measure(*procs, prompt_tokens, repeats, random.Random(0))
        itl_med = None
        if itl:
            rng = random.Random(1)
            runs = [itl_sample(procs[1], procs[2], prompt_tokens, 300, rng) for _ in range(repeats)]
            itl_med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        transport = pair_transport(procs[2])
    finally:
        for proc in procs:
            proc.stop()
    print(f"\nTTFT for a {prompt_tokens}-token prompt ({model}; KV over {transport}; KV {med['kv_mb']:.1f} MB; "
          f"median of {repeats})\n")
    print("| path | part | ms |")
    print("|---|---|---:|")
    print(f"| colocated | prefill + first token | {med['colocated']:.1f} |")
    print(f"| disaggregated, prefill first | prefill compute (prefill leg) | {med['prefill']:.1f} |")
    print(f"| | KV transfer (PULL to DONE) | {med['transfer']:.1f} |")
    print(f"| | handoff (decode leg minus transfer) | {med['handoff']:.1f} |")
    print(f"| | total | {med['pf_total']:.1f} |")
    print(f"| disaggregated, concurrent legs | total | {med['concurrent']:.1f} |")
    print(f"\noverhead vs colocated: prefill-first {med['pf_total'] - med['colocated']:+.1f} ms, "
          f"concurrent {med['concurrent'] - med['colocated']:+.1f} ms (difference of medians); "
          f"TTFT / colocated TTFT, median of per-round ratios: prefill-first {med['pf_ratio']:.3f}, "
          f"concurrent {med['concurrent_ratio']:.3f}")
    print(f"KV transfer bandwidth (bytes / PULL-to-DONE time, prefill-first legs): {med['transfer_gbps']:.2f} GB/s")
    if itl_med is not None:
        print(f"\nITL of a request decoding on D while a {prompt_tokens}-token prompt's KV arrives (median of "
              f"{repeats}): before {itl_med['itl_before']:.2f} ms, during p50 {itl_med['itl_during_p50']:.2f} ms, "
              f"during max {itl_med['itl_during_max']:.2f} ms (arrival: {itl_med['arrival']:.1f} ms)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=None, help="checkpoint every node serves (default: the embedded model)")
    parser.add_argument("--shape", default=None,
                        help="serve a random-weight checkpoint of this bench/gpu_engine.py shape, made on the GPU")
    parser.add_argument("--node-arg", action="append", default=[],
                        help="appended to every node's command line, e.g. --node-arg=--gpu-memory-utilization=0.28")
    parser.add_argument("--itl", action="store_true",
                        help="also measure a running request's inter-token gaps while another prompt's KV arrives")
    args = parser.parse_args()
    model = args.model
    if args.shape:
        import torch
        from gpu_engine import make_checkpoint

        if not torch.cuda.is_available():
            print("--shape makes its checkpoint on a GPU; CUDA is not available here")
            return
        model = str(make_checkpoint(args.shape, Path(tempfile.mkdtemp(prefix="pdserve-shape-"))))
    node_args = (["--model", model] if model else []) + args.node_arg
    label = f"{args.shape or model or 'embedded model'}, {' '.join(args.node_arg) or 'default flags'}"
    run(args.prompt_tokens, args.repeats, node_args, label, args.itl)


if __name__ == "__main__":
    main()
