"""What a huge prompt costs: time to its answer, and /health latency on every process meanwhile.

Starts the proxy, a prefill and a decode daemon (registered) and a colocated node on
loopback, then sends prompts of growing size through the proxy and straight to the node
while a thread polls ``/health`` on all four. Goals: every oversized prompt answered with
a 4xx in well under a second; /health never slower than 100 ms; no node evicted.

    .venv/bin/python bench/big_prompt_health.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers.cluster import pd_cluster  # noqa: E402

SIZES = {"none (baseline)": 0, "300 KB (tokenized)": 300_000, "1 MiB": 1 << 20, "4 MiB - 1 KB": (4 << 20) - 1024, "10 MB": 10_000_000}


class HealthPoller:
    """Polls /health on each URL back to back from its own process (so the client's own JSON
    encoding cannot delay it), keeping the slowest answer."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._worst = multiprocessing.Value("d", 0.0)
        self._failures = multiprocessing.Value("i", 0)
        self._stop = multiprocessing.Event()
        self._process = multiprocessing.Process(target=self._run, daemon=True)

    def start(self) -> None:
        self._process.start()

    def finish(self) -> tuple[float, int]:
        self._stop.set()
        self._process.join()
        return self._worst.value, self._failures.value

    def _run(self) -> None:
        with httpx.Client(timeout=5) as client:
            while not self._stop.is_set():
                for url in self.urls:
                    t0 = time.perf_counter()
                    try:
                        ok = client.get(url + "/health").status_code == 200
                    except httpx.HTTPError:
                        ok = False
                    self._worst.value = max(self._worst.value, time.perf_counter() - t0)
                    self._failures.value += not ok


def measure(url: str, chars: int, urls: list[str], repeats: int) -> tuple[int, float, float, int]:
    body = {"model": "pdserve-tiny", "prompt": "hello world " * (chars // 12)}
    poller = HealthPoller(urls)
    poller.start()
    times, status = [0.0], 0
    try:
        if not chars:  # the baseline: /health alone, for as long as a big request takes
            time.sleep(2)
        for _ in range(repeats if chars else 0):
            t0 = time.perf_counter()
            status = httpx.post(url + "/v1/completions", json=body, timeout=120).status_code
            times.append(time.perf_counter() - t0)
    finally:
        worst, failures = poller.finish()
    return status, max(times), worst, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-bigprompt-"))
    with pd_cluster(tmp) as procs:
        proxy, node = procs["proxy"], procs["both"]
        urls = [p.url for p in procs.values()]
        print("| target | prompt | status | slowest answer (s) | slowest /health (ms) | /health failures |")
        print("|---|---|---|---|---|---|")
        for name, url in (("proxy", proxy.url), ("node", node.url)):
            for label, chars in SIZES.items():
                status, slowest, health, failures = measure(url, chars, urls, args.repeats)
                print(f"| {name} | {label} | {status} | {slowest:.3f} | {health * 1e3:.1f} | {failures} |")
        nodes = [ln for ln in httpx.get(proxy.url + "/metrics").text.splitlines()
                 if ln.startswith("pdserve:registered_nodes")]
        print("\nregistered after:", ", ".join(ln.split("{")[1] for ln in nodes))

if __name__ == "__main__":
    main()
