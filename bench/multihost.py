"""TTFT of a 2,000-token prompt across hosts, with 0, 1 and 10 ms of one-way latency between P and D.

A prefill and a decode daemon run in two network namespaces (two hosts, each binding
0.0.0.0 and advertising its own address); a colocated node on loopback is the baseline.
The P-D traffic (KV control and data) goes over a link that delays each frame by the
chosen one-way latency: ``tc netem`` where the kernel has it, else a user-space relay
(tests/helpers/delay_relay.py; it adds about 0.05 ms of its own at 0 ms). The client's
HTTP legs are not delayed. The breakdown is bench/ttft_breakdown.py's (prefill leg,
transfer = D's ``kv_transfer_seconds``, hand-off = rest of D's first token), so the
cost of each round trip in the protocol shows as the growth of transfer and hand-off.

Needs root and ``ip`` (network namespaces).

    python bench/multihost.py [--prompt-tokens 2000] [--repeats 5] [--latencies-ms 0,1,10]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

from ttft_breakdown import kv_megabytes, medians, pair_transport, sample  # also puts the tree and tests/ on sys.path

from helpers.cluster import start  # noqa: E402
from helpers.netns import Bed, netem_unavailable, unavailable  # noqa: E402


def run(prompt_tokens: int, repeats: int, latencies_ms: list[float]) -> None:
    reason = unavailable()
    if reason:
        sys.exit(f"bench/multihost.py: cannot build the test bed: {reason}")
    use_netem = netem_unavailable() is None
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-multihost-"))
    bed = Bed()
    both = None
    try:
        p_host, d_host = bed.add_host("p"), bed.add_host("d")
        prefill = bed.start("prefill", p_host, tmp, wait=False)
        decode = bed.start("decode", d_host, tmp, wait=False)
        both = start("both", tmp, name="colocated", wait=False)
        for proc in (prefill, decode, both):
            proc.wait_ready(timeout=300)
        link = None if use_netem else bed.delay_link(p_host, d_host, mtu=65000)  # few frames to copy
        rng = random.Random(0)
        samples: dict[float, list[dict[str, float]]] = {ms: [] for ms in latencies_ms}
        # Latencies take turns round by round, so a change in the machine's load between
        # rounds shows in every row alike instead of in one.
        for round_ in range(repeats + 1):  # round 0 warms up every process on every setting
            for ms in latencies_ms:
                set_latency(bed, link, p_host, d_host, ms)
                one = sample(both, prefill, decode, prompt_tokens, rng)
                if round_:
                    samples[ms].append(one)
        results = {ms: medians(s) for ms, s in samples.items()}
        transport = pair_transport(decode)
    finally:
        if both is not None:
            both.stop()
        bed.close()
    print_table(results, prompt_tokens, repeats, "tc netem" if use_netem else "user-space relay", transport)


def set_latency(bed: Bed, link, p_host, d_host, ms: float) -> None:
    """``ms`` one-way each way between P and D: tc netem when ``link`` is None, else the relay."""
    if link is not None:
        link.set(ms)
        return
    for a, b in ((p_host, d_host), (d_host, p_host)):
        bed.clear_netem(a)
        if ms:
            bed.netem(a, b, f"delay {ms}ms")


def print_table(results: dict[float, dict[str, float]], prompt_tokens: int, repeats: int, how: str,
                transport: str) -> None:
    kv_mb = kv_megabytes(prompt_tokens)
    print(f"\nTTFT of a {prompt_tokens}-token prompt, P and D on two hosts (network namespaces; one-way "
          f"P-D latency added with {how}; embedded model, CPU fp32, KV over {transport}; KV {kv_mb:.1f} MB; "
          f"median of {repeats}, ms)\n")
    print("| one-way P-D latency | colocated | prefill leg | KV transfer | hand-off | prefill-first total "
          "| concurrent total | concurrent - colocated |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for ms, m in results.items():
        cells = [m[k] for k in ("colocated", "prefill", "transfer", "handoff", "pf_total", "concurrent")]
        print(f"| {ms:g} ms | " + " | ".join(f"{v:.1f}" for v in cells)
              + f" | {m['concurrent'] - m['colocated']:+.1f} |")
    low, high = min(results), max(results)
    if high > low:  # each one-way trip on the critical path adds the latency once
        trips = {k: (results[high][k] - results[low][k]) / (high - low)
                 for k in ("transfer", "handoff", "concurrent")}
        print(f"\none-way P-D trips on the path (growth from {low:g} to {high:g} ms / {high - low:g} ms): "
              f"transfer {trips['transfer']:.1f}, hand-off {trips['handoff']:.1f}, "
              f"concurrent total {trips['concurrent']:.1f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--latencies-ms", default="0,1,10", help="comma-separated one-way latencies")
    args = parser.parse_args()
    run(args.prompt_tokens, args.repeats, [float(x) for x in args.latencies_ms.split(",")])


if __name__ == "__main__":
    main()
