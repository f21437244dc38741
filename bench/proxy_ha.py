"""Proxy HA drill (issue 31): two proxies, 1 P, 2 D; ``kill -9`` one proxy under load, then restart it.

The cluster runs under one cluster key, every daemon with ``--proxy A,B``; both proxies use
``--disagg-policy always`` (each request crosses P -> D). ``--clients`` threads per proxy loop on
streamed greedy completions of four fixed prompts (tests/helpers/proxy_drill.py), each answer checked
against a colocated node's; a request that fails at its proxy is retried once through the other.
Proxy A is killed once ``--before`` requests succeeded, while a long stream through it is under way
(so one request is cut in flight, the rest refused), and the load runs on until ``--after``
more succeeded through B; then A is started again on its ports and asked until it answers right.
The prompts repeat, so the prefix cache serves most of each prompt: this measures the proxies'
failover, not the engine. Prints one markdown table per round; exits 1 if any request failed.

    python bench/proxy_ha.py --rounds 3 --heartbeat-interval-s 0.5
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers.cluster import Proc, start, stop_all
from helpers.proxy_drill import Load, expected_texts, restart_and_time, wait_for_counts
from helpers.waiting import wait_until

from common.cluster_auth import ClusterKey

MODEL = ("--model", "embedded", "--log-level", "warning")  # the tiny model the drill's prompts are for


def cluster(tmp: Path, heartbeat_s: float) -> dict[str, Proc]:
    key = ("--cluster-key-file", str(ClusterKey.generate(tmp / "cluster.key")))
    procs = {name: start("proxy", tmp, *key, "--disagg-policy", "always", "--log-level", "warning", name=name,
                         wait=False) for name in ("proxy_a", "proxy_b")}
    proxies = ",".join(f"127.0.0.1:{p.kv_port}" for p in procs.values())
    node = (*key, "--proxy", proxies, "--heartbeat-interval-s", str(heartbeat_s), *MODEL)
    for name, role in (("prefill", "prefill"), ("decode1", "decode"), ("decode2", "decode")):
        procs[name] = start(role, tmp, *node, name=name, wait=False)
    procs["both"] = start("both", tmp, *MODEL, wait=False)
    for proc in procs.values():
        proc.wait_ready()
    for proxy in (procs["proxy_a"], procs["proxy_b"]):
        wait_until(lambda p=proxy: httpx.get(p.url + "/ready").json().get("nodes") == {"P": 1, "D": 2},
                   f"every node registered with {proxy.name}")
    return procs


def one_round(procs: dict[str, Proc], expected: dict[str, str], args: argparse.Namespace) -> list[str]:
    victim, survivor = procs["proxy_a"], procs["proxy_b"]
    with Load(victim, survivor, expected, clients=args.clients) as load:
        wait_for_counts(load, lambda c: c.succeeded >= args.before, "requests before the kill")
        load.kill_victim()  # as a stream through it has begun
        wait_for_counts(load, lambda c: c.survivor_ok >= args.after and c.retried >= 1, "requests after the kill")
    comeback = restart_and_time(victim, expected)
    c = load.counts
    hb = args.heartbeat_interval_s
    up = max(comeback.registry_s, comeback.http_s)
    print(f"| {c.sent} | {c.succeeded} | {c.failed_fast} ({c.cut_in_flight}) | {c.retried} | {len(c.failed)} | "
          f"{up:.2f} s | {comeback.after_up_s:.2f} s ({comeback.after_up_s / hb:.1f}) |")
    return c.failed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--clients", type=int, default=2, help="client threads per proxy")
    parser.add_argument("--before", type=int, default=20, help="successes before the kill")
    parser.add_argument("--after", type=int, default=20, help="successes through the survivor after it")
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.5)
    args = parser.parse_args()
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="proxy-ha-") as tmp:
        procs = cluster(Path(tmp), args.heartbeat_interval_s)
        try:
            expected = expected_texts(procs["both"])
            print(f"| sent | succeeded | failed fast (cut in flight) | retried ok | failed | restart -> both "
                  f"ports listening | listening -> first right answer (heartbeats of {args.heartbeat_interval_s:g} s) |")
            print("|---:|---:|---:|---:|---:|---:|---:|")
            for _ in range(args.rounds):
                failed += one_round(procs, expected, args)
        finally:
            stop_all(procs.values())
    for why in failed[:20]:
        print("failed:", why)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
