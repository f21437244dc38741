"""Prefix caching + prefix-aware routing vs neither, on a multi-turn chat workload.

Starts a proxy, 2 prefill and 2 decode daemons (real processes, embedded model, CPU,
loopback) twice: once with prefix caching on every daemon and ``--policy prefix_aware``, once
with ``--no-enable-prefix-caching`` and ``round_robin``. Each time it runs the same
workload: a shared system prompt (1,000 tokens by default), 16 conversations of 4 turns
run side by side, each turn resending the whole history (greedy, streamed). Reports
TTFT p50/p99 at the client, prompt tokens the prefill daemons computed (prompt tokens
minus prefix-cache hits), KV bytes the decode daemons received, and whether every
answer is identical between the two runs.

    python bench/prefix_cache.py [--conversations 16] [--turns 4] [--system-tokens 1000]
    python bench/prefix_cache.py --conversations 4 --turns 2 --system-tokens 300   # quick check
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from common.model.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model  # noqa: E402
from common.model.tokenizer import Tokenizer  # noqa: E402
from helpers.cluster import Proc, metric, start  # noqa: E402
from helpers.sse import data_events  # noqa: E402
from helpers.stats import pct  # noqa: E402

QUESTIONS = ["How do I open a file?", "What does a for loop do?", "Explain the with statement.",
             "How are exceptions raised?", "What is a generator?", "How do imports work?",
             "What is a decorator?", "How do I format a string?"]


@dataclass
class RunResult:
    ttft_ms: list[float] = field(default_factory=list)
    answers: dict[tuple[int, int], str] = field(default_factory=dict)
    prompt_tokens: float = 0.0
    cache_hits: float = 0.0
    kv_bytes: float = 0.0


def system_prompt(num_tokens: int) -> str:
    """About ``num_tokens`` tokens of English text (Python's own help topics)."""
    import pydoc_data.topics

    tok = Tokenizer.from_dir(ensure_embedded_model())
    text = " ".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    return "You answer questions about Python. Reference:\n" + tok.decode(tok.encode(text)[:num_tokens])


COUNTERS = ("pdserve:prompt_tokens_total", "pdserve:prefix_cache_hits_total",
            "pdserve:kv_transfer_bytes_total")


def counters(url: str) -> dict[str, float]:
    return {name: metric(url, name) for name in COUNTERS}


# One client for every conversation thread, connections kept alive (a new httpx client per
# request costs 25-60 ms here: it loads the CA bundle, and that would land in every TTFT).
HTTP = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=64, max_keepalive_connections=64))


def chat_turn(url: str, messages: list[dict], max_tokens: int) -> tuple[float, str]:
    """(seconds to the first content token, the answer text) of one streamed chat request."""
    body = {"model": EMBEDDED_MODEL_NAME, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    first, text = None, ""
    for event in data_events(HTTP, url + "/v1/chat/completions", body):
        for choice in event.get("choices", []):
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece and first is None:
                first = time.perf_counter() - t0
            text += piece
    if first is None:
        raise RuntimeError("no token")
    return first, text


def conversation(url: str, i: int, system: str, turns: int, max_tokens: int, result: RunResult) -> None:
    messages = [{"role": "system", "content": system}]
    for t in range(turns):
        messages.append({"role": "user", "content": f"[{i}] " + QUESTIONS[(i + t) % len(QUESTIONS)]})
        seconds, answer = chat_turn(url, messages, max_tokens)
        result.ttft_ms.append(seconds * 1000)
        result.answers[(i, t)] = answer
        messages.append({"role": "assistant", "content": answer})


def wait_registered(proxy: Proc, per_type: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = httpx.get(proxy.url + "/metrics", timeout=5).text
        counts = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("pdserve:registered_nodes{")]
        if len(counts) == 2 and all(c >= per_type for c in counts):
            return
        time.sleep(0.2)
    raise RuntimeError(f"not every daemon registered with the proxy:\n{proxy.log_tail()}")


def run(caching: bool, args: argparse.Namespace, system: str) -> RunResult:
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-prefix-"))
    policy = "prefix_aware" if caching else "round_robin"
    proxy = start("proxy", tmp, "--policy", policy, wait=False)
    daemon_args = ["--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5"]
    if not caching:
        daemon_args.append("--no-enable-prefix-caching")
    procs = [proxy]
    try:
        for role in ("prefill", "prefill", "decode", "decode"):
            procs.append(start(role, tmp, *daemon_args, name=f"{role}{len(procs)}"))
        proxy.wait_ready()
        wait_registered(proxy, 2)
        daemons = procs[1:]
        with ThreadPoolExecutor(8) as pool:  # warm every node up (pairs, first-call costs), unmeasured
            list(pool.map(lambda k: chat_turn(proxy.url, [{"role": "user", "content": f"warm up {k}"}], 2),
                          range(8)))
        before = [counters(d.url) for d in daemons]
        result = RunResult()
        with ThreadPoolExecutor(args.conversations) as pool:
            futures = [pool.submit(conversation, proxy.url, i, system, args.turns, args.max_tokens, result)
                       for i in range(args.conversations)]
            for f in futures:
                f.result()
        for d, b in zip(daemons, before):
            delta = {k: v - b[k] for k, v in counters(d.url).items()}
            if d.name.startswith("prefill"):
                result.prompt_tokens += delta["pdserve:prompt_tokens_total"]
                result.cache_hits += delta["pdserve:prefix_cache_hits_total"]
            else:
                result.kv_bytes += delta["pdserve:kv_transfer_bytes_total"]
        return result
    finally:
        for proc in reversed(procs):
            proc.stop()


def report(on: RunResult, off: RunResult, args: argparse.Namespace) -> None:
    rows = [("prefix caching + prefix_aware", on), ("no caching, round_robin", off)]
    print(f"\nMulti-turn chat: {args.conversations} conversations x {args.turns} turns side by side, "
          f"{args.system_tokens}-token shared system prompt, {args.max_tokens} tokens per answer; "
          "proxy + 2 prefill + 2 decode daemons, embedded model, CPU fp32, KV pairs on loopback\n")
    print("| run | TTFT p50 ms | TTFT p99 ms | prefill tokens computed | KV bytes transferred |")
    print("|---|---:|---:|---:|---:|")
    for name, r in rows:
        computed = r.prompt_tokens - r.cache_hits
        print(f"| {name} | {statistics.median(r.ttft_ms):.0f} | {pct(r.ttft_ms, 0.99):.0f} | {computed:,.0f} "
              f"| {r.kv_bytes / 1e6:,.1f} MB |")
    p50 = statistics.median(on.ttft_ms) / statistics.median(off.ttft_ms)
    kv = on.kv_bytes / off.kv_bytes if off.kv_bytes else float("nan")
    tokens = (on.prompt_tokens - on.cache_hits) / max(off.prompt_tokens - off.cache_hits, 1)
    print(f"| ratio (on / off) | {p50:.2f} | {pct(on.ttft_ms, 0.99) / pct(off.ttft_ms, 0.99):.2f} "
          f"| {tokens:.2f} | {kv:.2f} |")
    same = sum(on.answers[k] == off.answers.get(k) for k in on.answers)
    print(f"\ngoals: TTFT p50 <= 0.5x: {'met' if p50 <= 0.5 else 'MISSED'} ({p50:.2f}x); "
          f"KV bytes <= 0.3x: {'met' if kv <= 0.3 else 'MISSED'} ({kv:.2f}x); "
          f"greedy answers identical: {same}/{len(on.answers)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    args = parser.parse_args()
    system = system_prompt(args.system_tokens)
    on = run(True, args, system)
    off = run(False, args, system)
    report(on, off, args)


if __name__ == "__main__":
    main()
