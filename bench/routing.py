"""Routing cost against the number of registered nodes (issue 11: it must not grow with P x D).

Two tables of ``Router.pick`` cost, in microseconds, with the candidate cache warm:
- *matched*: N prefill and N decode nodes of one model and fingerprint (all pair);
- *unmatched*: one real pair plus N prefill and N decode nodes whose fingerprints never
  match (what a flood of fake registrations looks like; main's router scanned P x D here).
Plus the first pick after a membership change (the cache is rebuilt: O(N log N) once).

    python bench/routing.py [--sizes 1 16 256 1024] [--picks 2000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.registry_client import RegistrationMessage  # noqa: E402
from proxy.registry import ServiceRegistry  # noqa: E402
from proxy.routing import Router  # noqa: E402


def _node(kind: str, i: int, fp: str) -> RegistrationMessage:
    return RegistrationMessage(kind, f"10.{'PD'.index(kind)}.{i // 250}.{i % 250}:8000", "10.0.0.1:1",
                               model="m", kv_fingerprint=fp)


def _registry(n: int, matched: bool) -> ServiceRegistry:
    reg = ServiceRegistry(port=0, max_nodes=2 * n + 100)  # never started: the table is enough
    for i in range(n):
        reg.register(_node("P", i, "f" if matched else f"p{i}"))
        reg.register(_node("D", i, "f" if matched else f"d{i}"))
    if not matched:
        reg.register(_node("P", n, "f"))
        reg.register(_node("D", n, "f"))
    return reg


def _per_pick_us(router: Router, picks: int) -> float:
    start = time.perf_counter()
    for _ in range(picks):
        pair = router.pick("m")
        router.begin(pair)
        router.end(pair)
    return (time.perf_counter() - start) / picks * 1e6


def _after_change_us(reg: ServiceRegistry, router: Router, rounds: int = 20) -> float:
    total = 0.0
    for i in range(rounds):
        reg.register(RegistrationMessage("D", f"10.200.0.{i}:1", "10.0.0.1:1", model="m", kv_fingerprint="f"))
        start = time.perf_counter()
        router.pick("m")
        total += time.perf_counter() - start
    return total / rounds * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 256, 1024])
    parser.add_argument("--picks", type=int, default=2000)
    args = parser.parse_args()
    print("| scenario | nodes per role | round_robin µs/pick | least_loaded µs/pick | first pick after a change µs |")
    print("|---|---|---|---|---|")
    for matched in (True, False):
        for n in args.sizes:
            reg = _registry(n, matched)
            rr, ll = Router(reg, "round_robin"), Router(reg, "least_loaded")
            rr_us, ll_us = _per_pick_us(rr, args.picks), _per_pick_us(ll, args.picks)
            name = "matched" if matched else "unmatched"
            print(f"| {name} | {n} | {rr_us:.1f} | {ll_us:.1f} | {_after_change_us(reg, rr):.0f} |")


if __name__ == "__main__":
    main()
