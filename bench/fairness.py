"""Fair share between clients (README: Fair share): does one client's flood delay another's
small requests, and what does sharing cost in throughput?

A colocated node (``pdserve serve``, embedded model unless ``--model``) is started three times:
client A's flood with B beside it, with ``--fair-share on`` and ``off``, then client B alone (its
idle TTFT), sending as many requests as it sent beside A with fair share on, so that both p99s are
taken over as many samples (over 20, as before, the idle "p99" was the largest of 20, set against
the largest of ~80 beside A; the table also gives the idle p99 of the first 20). A (API key ``key-A``) sends ``--a-requests`` requests at once, each ``n`` =
``--a-n`` choices of ``--a-tokens`` tokens (ignore_eos); B (``key-B``) streams ``--b-tokens``-token
requests at ``--b-rate`` per second while A's run. B's TTFT is measured at its client (first
streamed token); throughput is every completion token of A and B over the time from A's first
request to its last reply. Prompts differ per request (prefix caching reuses nothing but the
chat-less ``--prompt-words`` of filler each repeats; it is the same in every row).

    python bench/fairness.py [--a-requests 8 --a-n 16 --a-tokens 512 --b-rate 2 --b-tokens 4]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Node:
    def __init__(self, args: argparse.Namespace, fair_share: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix="fairness-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--port", str(self.port), "--model", args.model,
               "--fair-share", fair_share, "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning"]
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        self.popen = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=ROOT)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise SystemExit(f"the node exited; see {self.log.name}")
            try:
                if httpx.get(self.url + "/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"the node was not ready in {timeout} s; see {self.log.name}")

    def stop(self) -> None:
        self.popen.terminate()
        try:
            self.popen.wait(30)
        except subprocess.TimeoutExpired:
            self.popen.kill()


async def b_request(client: httpx.AsyncClient, i: int, args: argparse.Namespace) -> tuple[float, int]:
    """(TTFT, completion tokens) of one streamed request of B."""
    body = {"prompt": f"b {i} " + "word " * args.prompt_words, "max_tokens": args.b_tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    start, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json=body, headers={"Authorization": "Bearer key-B"}) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if ttft is None and '"text"' in line:
                ttft = time.perf_counter() - start
            if '"usage"' in line and '"completion_tokens"' in line:
                tokens = int(line.split('"completion_tokens":')[1].split(",")[0].split("}")[0])
    return ttft if ttft is not None else float("nan"), tokens


async def a_request(client: httpx.AsyncClient, i: int, args: argparse.Namespace) -> int:
    body = {"prompt": f"a {i} " + "word " * args.prompt_words, "max_tokens": args.a_tokens, "n": args.a_n,
            "ignore_eos": True}
    resp = await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer key-A"})
    resp.raise_for_status()
    return resp.json()["usage"]["completion_tokens"]


async def b_stream(client: httpx.AsyncClient, args: argparse.Namespace, until: asyncio.Event | None,
                   count: int) -> list[tuple[float, int]]:
    """B's requests at ``--b-rate`` per second: ``count`` of them, or until ``until`` is set."""
    tasks, i = [], 0
    while (until is None and i < count) or (until is not None and not until.is_set()):
        tasks.append(asyncio.create_task(b_request(client, i, args)))
        i += 1
        await asyncio.sleep(1 / args.b_rate)
    return list(await asyncio.gather(*tasks))


async def run_case(url: str, args: argparse.Namespace, flood: bool) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=3600) as client:
        if not flood:
            results = await b_stream(client, args, None, args.idle_b_requests)
            return {"ttfts": [t for t, _ in results]}
        done = asyncio.Event()
        start = time.perf_counter()
        a_tasks = [asyncio.create_task(a_request(client, i, args)) for i in range(args.a_requests)]
        b_task = asyncio.create_task(b_stream(client, args, done, 0))
        a_tokens = sum(await asyncio.gather(*a_tasks))
        elapsed = time.perf_counter() - start
        done.set()
        results = await b_task
        b_tokens = sum(n for _, n in results)
        return {"ttfts": [t for t, _ in results], "tokens_per_s": (a_tokens + b_tokens) / elapsed,
                "elapsed": elapsed}


def p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def measure(args: argparse.Namespace, fair_share: str, flood: bool) -> dict:
    node = Node(args, fair_share)
    try:
        node.wait_ready()
        return asyncio.run(run_case(node.url, args, flood))
    finally:
        node.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="embedded")
    parser.add_argument("--a-requests", type=int, default=8)
    parser.add_argument("--a-n", type=int, default=16)
    parser.add_argument("--a-tokens", type=int, default=512)
    parser.add_argument("--b-rate", type=float, default=2.0, help="B's requests per second")
    parser.add_argument("--b-tokens", type=int, default=4)
    parser.add_argument("--idle-b-requests", type=int, default=0,
                        help="B's requests alone (0: as many as B sent beside A with fair share on)")
    parser.add_argument("--prompt-words", type=int, default=32)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    args = parser.parse_args()
    on, off = measure(args, "on", True), measure(args, "off", True)
    args.idle_b_requests = args.idle_b_requests or len(on["ttfts"])
    idle = measure(args, "on", flood=False)
    rows = {"B alone": idle, "A + B, fair share on": on, "A + B, fair share off": off}
    idle_p99 = p(idle["ttfts"], 0.99)
    off_tps = rows["A + B, fair share off"]["tokens_per_s"]
    print(f"A: {args.a_requests} x (n={args.a_n}, {args.a_tokens} tokens); B: {args.b_tokens}-token requests at "
          f"{args.b_rate:g}/s; model {args.model}; max-num-seqs {args.max_num_seqs}\n")
    print("| case | B requests | B TTFT p50 (ms) | B TTFT p99 (ms) | B p99 / idle p99 | tokens/s | vs off |")
    print("|---|---|---|---|---|---|---|")
    for name, row in rows.items():
        tps = row.get("tokens_per_s")
        print(f"| {name} | {len(row['ttfts'])} | {1e3 * statistics.median(row['ttfts']):.0f} | "
              f"{1e3 * p(row['ttfts'], 0.99):.0f} | {p(row['ttfts'], 0.99) / idle_p99:.1f}x | "
              f"{'' if tps is None else f'{tps:.0f}'} | {'' if tps is None else f'{100 * tps / off_tps:.0f} %'} |")
    print("\nB's TTFTs in send order (ms): the first (sent with A's flood into a node just started), then the rest")
    for name, row in rows.items():
        ms = [round(1e3 * t) for t in row["ttfts"]]
        print(f"- {name}: first {ms[0] if ms else ''}; rest max {max(ms[1:], default='')}: {ms[1:]}")
    on = rows["A + B, fair share on"]
    print(f"\nB alone, first 20 requests: p99 {1e3 * p(idle['ttfts'][:20], 0.99):.0f} ms "
          f"(B p99 on / that: {p(on['ttfts'], 0.99) / p(idle['ttfts'][:20], 0.99):.1f}x)")
    print(f"\ngoal B p99 <= 2x idle p99: {'met' if p(on['ttfts'], 0.99) <= 2 * idle_p99 else 'missed'}; "
          f"goal throughput >= 95 % of off: {'met' if on['tokens_per_s'] >= 0.95 * off_tps else 'missed'}")


if __name__ == "__main__":
    main()
