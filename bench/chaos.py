"""Chaos: a mixed streaming load on proxy + 2P + 2D while a node is killed and restarted.

Two phases of ``--seconds`` each on the same cluster: calm (no kills), then chaos (every
``--kill-every-s`` one node, decode and prefill in turn, gets SIGKILL and a fresh one is started).
``--concurrency`` clients loop on streamed completions and chats (greedy, mixed prompt and output
lengths, fresh prompts: what the prefix cache reuses is only the shared instruction text).

A request counts as a client-visible failure when its status is not 200, an error event is in its
stream, or it ends without ``[DONE]``/finish_reason. Migrations are the proxy's
``pdserve:proxy_migrations_total``; blocks leaked are the KV blocks still in use on each live node
once the load stopped and the nodes went idle, as the fraction of a node's KV cache still in use
summed over the live nodes (goal 0).

    python bench/chaos.py --seconds 90 --kill-every-s 15 --concurrency 16 --migration-limit 2
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from helpers.cluster import Proc, metric, start  # noqa: E402

WORDS = "with statement block context manager exception class function module import loop value".split()


class Cluster:
    def __init__(self, tmp: Path, migration_limit: int) -> None:
        self.tmp = tmp
        self.proxy = start("proxy", tmp, "--heartbeat-timeout-s", "2", "--stream-idle-timeout-s", "5",
                           "--migration-limit", str(migration_limit), "--log-level", "warning", wait=False)
        self.nodes: list[Proc] = []
        self.serial = 0
        for role in ("prefill", "prefill", "decode", "decode"):
            self.add(role)
        self.proxy.wait_ready(timeout=120)

    def add(self, role: str) -> None:
        self.serial += 1
        self.nodes.append(start(role, self.tmp, "--proxy", f"127.0.0.1:{self.proxy.kv_port}",
                                "--heartbeat-interval-s", "0.5", name=f"{role}{self.serial}"))

    def kill_and_restart(self, role: str) -> None:
        victim = next(n for n in self.nodes if n.name.startswith(role))
        victim.kill()
        self.nodes.remove(victim)
        self.add(role)

    def stop(self) -> None:
        for proc in [*self.nodes, self.proxy]:
            proc.stop()


def one_request(url: str, rng: random.Random) -> tuple[bool, float | None]:
    """(ok, seconds to the first content) for one streamed request."""
    chat = rng.random() < 0.5
    words = " ".join(rng.choice(WORDS) for _ in range(rng.choice((8, 40, 160))))
    body: dict = {"max_tokens": rng.choice((16, 64, 160)), "temperature": 0, "ignore_eos": True, "stream": True}
    if chat:
        body["messages"] = [{"role": "user", "content": f"{rng.random()} {words}"}]
    else:
        body["prompt"] = f"{rng.random()} {words}"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    start_t, ttft, finished, done = time.perf_counter(), None, False, False
    try:
        with httpx.stream("POST", url + path, json=body, timeout=120) as r:
            if r.status_code != 200:
                return False, None
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    event = json.loads(line[6:])
                    if "error" in event:
                        return False, ttft
                    for choice in event.get("choices", []):
                        text = choice.get("text") or (choice.get("delta") or {}).get("content")
                        if text and ttft is None:
                            ttft = time.perf_counter() - start_t
                        finished = finished or bool(choice.get("finish_reason"))
    except httpx.HTTPError:
        return False, ttft
    return done and finished, ttft


def run_phase(url: str, seconds: float, concurrency: int, chaos: Cluster | None, kill_every_s: float) -> dict:
    results: list[tuple[bool, float | None]] = []
    lock = threading.Lock()
    stop_at = time.monotonic() + seconds

    def client(seed: int) -> None:
        rng = random.Random(seed)
        while time.monotonic() < stop_at:
            outcome = one_request(url, rng)
            with lock:
                results.append(outcome)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    kills = 0
    if chaos is not None:
        roles = ["decode", "prefill"]
        while time.monotonic() + kill_every_s < stop_at:
            time.sleep(kill_every_s)  # the chaos schedule itself, not a wait on a condition
            chaos.kill_and_restart(roles[kills % 2])
            kills += 1
    for t in threads:
        t.join()
    ttfts = sorted(t for ok, t in results if ok and t is not None)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan")
    return {"requests": len(results), "failures": sum(not ok for ok, _ in results), "kills": kills,
            "ttft_p99_ms": p99 * 1e3}


def migrations(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("pdserve:proxy_migrations_total{"))


def leaked_blocks(cluster: Cluster, timeout: float = 60.0) -> float:
    """The KV cache still in use (fraction of a node's blocks, summed over the live nodes) once
    they have had time to go idle: anything above 0 is leaked blocks."""
    deadline = time.monotonic() + timeout
    while True:
        used = sum(metric(node.url, "pdserve:kv_cache_usage_perc") for node in cluster.nodes)
        if used == 0 or time.monotonic() > deadline:
            return used
        time.sleep(0.5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=90.0, help="length of each phase (calm, chaos)")
    ap.add_argument("--kill-every-s", type=float, default=15.0)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--migration-limit", type=int, default=2)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="pdserve-chaos-") as tmp:
        cluster = Cluster(Path(tmp), args.migration_limit)
        try:
            calm = run_phase(cluster.proxy.url, args.seconds, args.concurrency, None, args.kill_every_s)
            calm["migrations"] = migrations(cluster.proxy.url)
            chaos = run_phase(cluster.proxy.url, args.seconds, args.concurrency, cluster, args.kill_every_s)
            chaos["migrations"] = migrations(cluster.proxy.url) - calm["migrations"]
            chaos["leaked_blocks"] = calm["leaked_blocks"] = leaked_blocks(cluster)
        finally:
            cluster.stop()
    print(f"c{args.concurrency}, {args.seconds:g} s a phase, a kill every {args.kill_every_s:g} s, "
          f"--migration-limit {args.migration_limit}")
    print("| phase | requests | client-visible failures | migrations | kills | TTFT p99 (ms) | KV in use after (goal 0) |")
    print("|---|---|---|---|---|---|---|")
    for name, r in (("calm", calm), ("chaos", chaos)):
        print(f"| {name} | {r['requests']} | {r['failures']} | {r['migrations']:g} | {r['kills']} | "
              f"{r['ttft_p99_ms']:.0f} | {r['leaked_blocks']:g} |")


if __name__ == "__main__":
    main()
