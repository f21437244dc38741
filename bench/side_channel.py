"""The prefix cache's timing side channel, without and with per-tenant salts.

A victim tenant sends a prompt that opens with a secret 1,500-token prefix. An attacker
holding a guess sends it with a suffix of its own and times the first token: if the guess is
right, its prefix is already cached and TTFT drops. The control is a 1,500-token prefix that
nobody sent. Both tenants talk to one proxy with their own API key.

Starts a proxy, a prefill and a decode daemon (real processes, embedded model, CPU, loopback,
prefix caching on, ``--disagg-policy always`` so every prompt takes the same path) twice:
once as shipped (no salt: all tenants share one cache), once with
``--cache-salt-from-api-key``. Each round uses a new secret and a new control prefix (so no
round measures what an earlier one cached): the victim sends its prompt, then the attacker
sends the guessed and the unsent prefix in alternating order. Streamed, 1 token, greedy.
Reports TTFT medians and p10/p90 over the rounds, and how often the attacker guessed right by
calling "sent" whichever of the two probes answered first (50% = no signal).

    python bench/side_channel.py [--rounds 40] [--prefix-tokens 1500]
    python bench/side_channel.py --rounds 8                     # quick check
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from common.model.embedded import EMBEDDED_MODEL_NAME  # noqa: E402
from helpers.cluster import start  # noqa: E402
from helpers.sse import data_events  # noqa: E402
from helpers.stats import pct  # noqa: E402

HTTP = httpx.Client(timeout=600)  # one client, kept-alive connections: no per-request set-up in TTFT


def ttft(url: str, key: str, prompt: list[int]) -> float:
    """Seconds from sending a streamed completion to its first token, as tenant ``key``."""
    body = {"model": EMBEDDED_MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    for event in data_events(HTTP, url + "/v1/completions", body, {"Authorization": f"Bearer {key}"}):
        if "error" in event:
            raise RuntimeError(f"stream failed: {event['error']}")
        if event.get("choices"):  # the first token's event (its text may be empty: a partial character)
            return time.perf_counter() - t0
    raise RuntimeError("no token")


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(4, 2000) for _ in range(n)]


def run(salted: bool, args: argparse.Namespace) -> tuple[list[float], list[float], int]:
    """TTFTs of the guessed (sent) and the unsent prefix per round, and rounds the guess was right."""
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-side-channel-"))
    proxy_args = ["--disagg-policy", "always", *(["--cache-salt-from-api-key"] if salted else [])]
    proxy = start("proxy", tmp, *proxy_args, wait=False)
    daemon_args = ["--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5"]
    procs = [proxy]
    try:
        for role in ("prefill", "decode"):
            procs.append(start(role, tmp, *daemon_args, name=role))
        proxy.wait_ready()
        rng = random.Random(1)
        for _ in range(3):  # warm up: the P-D pair, first-call costs (unmeasured)
            ttft(proxy.url, "warm-up", tokens(rng, args.prefix_tokens + 16))
        sent, unsent, right = [], [], 0
        for i in range(args.rounds):
            secret, control = tokens(rng, args.prefix_tokens), tokens(rng, args.prefix_tokens)
            ttft(proxy.url, "victim", secret + tokens(rng, 40))
            probe = tokens(rng, 16)  # the attacker's own suffix: its guess is only the prefix
            probes = [("sent", secret + probe), ("unsent", control + probe)]
            got = {name: ttft(proxy.url, "attacker", p) for name, p in (probes if i % 2 else probes[::-1])}
            sent.append(got["sent"] * 1e3)
            unsent.append(got["unsent"] * 1e3)
            right += got["sent"] < got["unsent"]
        return sent, unsent, right
    finally:
        for proc in reversed(procs):
            proc.stop()


def report(results: dict[str, tuple[list[float], list[float], int]], args: argparse.Namespace) -> None:
    print(f"\nTiming side channel: a guessed {args.prefix_tokens:,}-token prefix another tenant sent vs one "
          f"nobody sent; {args.rounds} rounds, 1 streamed token each; proxy + prefill + decode daemons, "
          "embedded model, CPU fp32, loopback\n")
    print("| proxy | TTFT sent prefix, median ms (p10-p90) | TTFT unsent prefix, median ms (p10-p90) "
          "| sent / unsent | attacker right |")
    print("|---|---:|---:|---:|---:|")
    for name, (sent, unsent, right) in results.items():
        ratio = statistics.median(sent) / statistics.median(unsent)
        print(f"| {name} | {statistics.median(sent):.1f} ({pct(sent, 0.1):.1f}-{pct(sent, 0.9):.1f}) "
              f"| {statistics.median(unsent):.1f} ({pct(unsent, 0.1):.1f}-{pct(unsent, 0.9):.1f}) "
              f"| {ratio:.2f} | {right}/{len(sent)} ({100 * right / len(sent):.0f}%) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    args = parser.parse_args()
    results = {"shared cache (no salt)": run(False, args),
               "--cache-salt-from-api-key": run(True, args)}
    report(results, args)


if __name__ == "__main__":
    main()
