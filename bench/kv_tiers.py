"""KV tiers off vs on: a multi-turn chat trace whose working set is many times the prefill node's pool.

Starts a proxy, one prefill and one decode daemon (real processes, embedded model, CPU, loopback;
P->D, ``--disagg-policy always``) twice: once without tiers, once with a file tier on the prefill
node (``--kv-disk-dir`` in a temp dir, ``--kv-offload-on-finish``). The prefill node's pool is made
small (``--pool-blocks``, the decode node's too: one with room for the whole trace would keep every
prefix itself and compute each turn's new tokens locally, never asking the prefill node); each of ``--conversations`` conversations has a system prompt of its own
(``--system-tokens``; its first block differs, so no two conversations share a block) and runs
``--turns`` turns, each resending the whole history. The turns go in waves (every conversation's
turn 1, then every conversation's turn 2, ...), ``--concurrency`` at a time, so between two turns
of one conversation the others have pushed its blocks out of the pool: what the second turn
finds is what the tiers kept (with tiers off: nothing but what the pool still holds).

What it reuses, said plainly: every turn >= 2 resends a prefix that was computed before; the
trace measures whether that prefix comes back from a tier or is computed again. The node's
prefill on the tiny embedded model is cheap, so the TTFT ratio here is far below what a real
model's (quadratic, GPU-bound) prefill gives; the hit rates and the answers are the point.

Prints: hit rate by tier (prefill node: pool hits and file-tier hits over prompt tokens looked
up), TTFT p50/p99 of turns >= 2, ITL p50/p99 (each request's mean gap between tokens: streamed
chunks arrive several per read, so single gaps say little), output tokens/s,
KV bytes moved P->D, and whether every answer is identical with tiers on and off.

    python bench/kv_tiers.py [--conversations 16] [--turns 4] [--system-tokens 1200] [--pool-blocks 256]

On a GPU (``make gpu-check``'s kv_tiers step): ``--model DIR --token-ids --tier host
--node-arg=--device=cuda --node-arg=--gpu-memory-utilization=0.2 --node-arg=--kv-transport=cuda_ipc``:
a checkpoint without a chat template gets random token-id prompts (each conversation's own system
ids, then a new question of ids each turn; its answers are not resent), and the prefill node's tier
is its pinned host tier (``--kv-host-bytes``), not files. ``--json PATH`` writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench.prefix_cache import QUESTIONS, system_prompt, wait_registered  # noqa: E402
from common.model.embedded import EMBEDDED_MODEL_NAME  # noqa: E402
from helpers.cluster import Proc, labelled, metric, start  # noqa: E402
from helpers.sse import data_events  # noqa: E402
from helpers.stats import pct  # noqa: E402

HTTP = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=32, max_keepalive_connections=32))
BLOCK_SIZE = 16


@dataclass
class RunResult:
    ttft_ms: list[float] = field(default_factory=list)  # turns >= 2
    itl_ms: list[float] = field(default_factory=list)  # per request: (last token - first) / (tokens - 1)
    decoding: list[tuple[float, float]] = field(default_factory=list)  # per request: first token to last, as seen

    def overlap(self) -> float:
        """The share of the requests' decoding time (first token to last) during which another
        request was decoding too: the decode node ran a batch of two or more."""
        edges = sorted([(a, 1) for a, _ in self.decoding] + [(b, -1) for _, b in self.decoding])
        total = shared = 0.0
        active, at = 0, edges[0][0] if edges else 0.0
        for t, step in edges:
            total += active * (t - at)
            shared += active * (t - at) if active >= 2 else 0.0
            active, at = active + step, t
        return shared / total if total else 0.0
    answers: dict[tuple[int, int], str] = field(default_factory=dict)
    output_tokens: int = 0
    seconds: float = 0.0
    counters: dict[str, float] = field(default_factory=dict)


def chat_turn(url: str, messages: list[dict], max_tokens: int,
              model: str = EMBEDDED_MODEL_NAME) -> tuple[float, float, str, int]:
    """(seconds to the first token, to the last, the answer, its tokens) of one streamed turn."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    return _timed_stream(url + "/v1/chat/completions", body, lambda c: (c.get("delta") or {}).get("content") or "")


def completion_turn(url: str, prompt: list[int], max_tokens: int, model: str | None) -> tuple[float, float, str, int]:
    """:func:`chat_turn` for a prompt of token ids (a model without a chat template)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, **({"model": model} if model else {})}
    return _timed_stream(url + "/v1/completions", body, lambda c: c.get("text") or "")


def _timed_stream(url: str, body: dict, piece: Callable[[dict], str]) -> tuple[float, float, str, int]:
    t0 = time.perf_counter()
    stamps, text, tokens = [], "", 0
    for event in data_events(HTTP, url, body):
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
        for choice in event.get("choices", []):
            if got := piece(choice):
                stamps.append(time.perf_counter() - t0)
                text += got
    if not stamps:
        raise RuntimeError("no token")
    return stamps[0], stamps[-1], text, tokens


COUNTERS = {  # prefill node's figures (the decode node's KV bytes separately)
    "queries": "pdserve:prefix_cache_queries_total",
    "hits": "pdserve:prefix_cache_hits_total",
}


def prefill_counters(url: str, tier: str = "disk") -> dict[str, float]:
    """The prefill node's prefix-cache figures and those of its KV tier ``tier`` ("disk", "host")."""
    out = {k: metric(url, name) for k, name in COUNTERS.items()}
    out["tier_blocks"] = labelled(url, "pdserve:kv_tier_hits_total", tier=tier)
    out["tier_errors"] = labelled(url, "pdserve:kv_tier_errors_total", tier=tier)
    out["tier_dropped"] = labelled(url, "pdserve:kv_tier_dropped_total", tier=tier)
    return out


def run(tiers: bool, args: argparse.Namespace, systems: list[str]) -> RunResult:
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-kv-tiers-"))
    proxy = start("proxy", tmp, "--disagg-policy", "always", wait=False)
    # both pools small: a decode node with room for the whole trace would keep every conversation's
    # prefix itself and compute each new turn's few tokens locally, and P (and its tiers) would not be asked
    common = ["--model", args.model, "--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5",
              "--block-size", str(BLOCK_SIZE), "--num-kv-blocks", str(args.pool_blocks), *args.node_arg]
    prefill_args = list(common)
    if tiers:
        where = ["--kv-host-bytes", str(args.host_bytes)] if args.tier == "host" else ["--kv-disk-dir", str(tmp / "kv")]
        prefill_args += [*where, "--kv-tier-load", args.kv_tier_load]
        if args.offload_on_finish:
            prefill_args.append("--kv-offload-on-finish")
    procs: list[Proc] = [proxy]
    try:
        prefill = start("prefill", tmp, *prefill_args, name="prefill", wait=False)
        decode_args = list(common)
        if tiers and args.decode_tiers:
            decode_args += ["--kv-disk-dir", str(tmp / "kv-decode"), "--kv-tier-load", args.kv_tier_load]
        decode = start("decode", tmp, *decode_args, name="decode", wait=False)
        procs += [prefill, decode]
        for proc in (prefill, decode, proxy):
            proc.wait_ready()
        if args.pin:  # P and D on a core each, as on two machines: P's file writes do not share D's core
            from bench.adaptive import pin

            pin(prefill, {0})
            pin(decode, {1})
        wait_registered(proxy, 1)
        tier = "host" if args.tier == "host" else "disk"
        if args.token_ids:  # the pair, first-call costs
            completion_turn(proxy.url, [5, 6, 7], 2, args.served_model_name)
        else:
            chat_turn(proxy.url, [{"role": "user", "content": "warm up"}], 2)
        before = prefill_counters(prefill.url, tier)
        kv_before = metric(decode.url, "pdserve:kv_transfer_bytes_total")
        result = RunResult()
        histories = [[{"role": "system", "content": s}] for s in systems]
        rng = random.Random(7)  # --token-ids: the same ids in every run
        id_histories = [[rng.randrange(4, 2048) for _ in range(args.system_tokens)] for _ in systems]
        questions = [[[rng.randrange(4, 2048) for _ in range(16)] for _ in range(args.turns)] for _ in systems]
        started = time.perf_counter()
        for turn in range(args.turns):  # a wave: every conversation's turn, --concurrency at a time
            def one(i: int, turn: int = turn) -> None:
                sent = time.perf_counter()
                if args.token_ids:
                    id_histories[i] += questions[i][turn]
                    ttft, last, answer, tokens = completion_turn(proxy.url, list(id_histories[i]), args.max_tokens,
                                                                 args.served_model_name)
                else:
                    messages = histories[i]
                    messages.append({"role": "user", "content": QUESTIONS[(i + turn) % len(QUESTIONS)]})
                    ttft, last, answer, tokens = chat_turn(proxy.url, messages, args.max_tokens)
                    messages.append({"role": "assistant", "content": answer})
                if turn:
                    result.ttft_ms.append(ttft * 1000)
                if tokens > 1:  # chunks can arrive several per read: a request's mean gap, not each gap
                    result.itl_ms.append((last - ttft) * 1000 / (tokens - 1))
                result.decoding.append((sent + ttft, sent + last))
                result.answers[(i, turn)] = answer
                result.output_tokens += tokens

            with ThreadPoolExecutor(args.concurrency) as pool:
                list(pool.map(one, range(args.conversations)))
        result.seconds = time.perf_counter() - started
        after = prefill_counters(prefill.url, tier)
        result.counters = {k: after[k] - before[k] for k in after}
        result.counters["kv_bytes"] = metric(decode.url, "pdserve:kv_transfer_bytes_total") - kv_before
        return result
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def report(on: RunResult, off: RunResult, args: argparse.Namespace, working_tokens: int) -> None:
    pool_tokens = args.pool_blocks * BLOCK_SIZE
    print(f"\nMulti-turn chat: {args.conversations} conversations x {args.turns} turns in waves, "
          f"{args.concurrency} at a time; {args.system_tokens}-token system prompt of its own each, "
          f"{args.max_tokens} tokens per answer; working set ~{working_tokens:,} tokens = "
          f"{working_tokens / pool_tokens:.1f}x a node's pool ({args.pool_blocks} blocks x {BLOCK_SIZE}); "
          f"proxy + prefill + decode (P->D), {args.model} model{' ' + ' '.join(args.node_arg) if args.node_arg else ''}"
          "\n")
    tier = "host-tier" if args.tier == "host" else "file-tier"
    print(f"| tiers | pool hit rate | {tier} hit rate | TTFT p50 ms (turns>=2) | TTFT p99 ms | ITL p50 ms "
          "| ITL p99 ms | decoding beside another | output tok/s | KV bytes P->D | tier errors / dropped stores |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    on_name = (f"on ({'host' if args.tier == 'host' else 'file'} tier{' on P and D' if args.decode_tiers else ''}, "
               f"--kv-tier-load {args.kv_tier_load}{', --kv-offload-on-finish' if args.offload_on_finish else ''})")
    for name, r in (("off", off), (on_name, on)):
        c = r.counters
        queries = max(c["queries"], 1)
        tier_tokens = c["tier_blocks"] * BLOCK_SIZE
        print(f"| {name} | {(c['hits'] - tier_tokens) / queries:.1%} | {tier_tokens / queries:.1%} "
              f"| {statistics.median(r.ttft_ms):.1f} | {pct(r.ttft_ms, 0.99):.1f} | {statistics.median(r.itl_ms):.2f} "
              f"| {pct(r.itl_ms, 0.99):.2f} | {r.overlap():.0%} | {r.output_tokens / r.seconds:.1f} "
              f"| {c['kv_bytes'] / 1e6:,.1f} MB "
              f"| {c['tier_errors']:.0f} / {c['tier_dropped']:.0f} |")
    same = sum(on.answers[k] == off.answers.get(k) for k in on.answers)
    ratio = statistics.median(off.ttft_ms) / statistics.median(on.ttft_ms)
    itl = statistics.median(on.itl_ms) / statistics.median(off.itl_ms) - 1
    print(f"\nTTFT p50 of turns >= 2, off / on: {ratio:.2f}x; ITL p50 change with tiers: {itl:+.1%}; "
          f"answers identical: {same}/{len(on.answers)}")
    if args.json:
        figures = {"ttft_ratio": ratio, "itl_p50_change": itl, "identical": same, "answers": len(on.answers),
                   "tier": args.tier, "system_tokens": args.system_tokens,
                   "tier_hit_rate": on.counters["tier_blocks"] * BLOCK_SIZE / max(on.counters["queries"], 1),
                   "itl_p99_change": pct(on.itl_ms, 0.99) / pct(off.itl_ms, 0.99) - 1,
                   "tier_errors": on.counters["tier_errors"], "overlap_off": off.overlap(), "overlap_on": on.overlap()}
        Path(args.json).write_text(json.dumps(figures, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1200)
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per answer")
    parser.add_argument("--pool-blocks", type=int, default=256, help="each node's --num-kv-blocks")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--offload-on-finish", action=argparse.BooleanOptionalAction, default=True,
                        help="the prefill node's --kv-offload-on-finish with tiers on")
    parser.add_argument("--decode-tiers", action="store_true",
                        help="with tiers on, a file tier on the decode node too (it then asks P only for what it lacks)")
    parser.add_argument("--kv-tier-load", choices=("auto", "always"), default="auto",
                        help="the prefill node's --kv-tier-load with tiers on")
    parser.add_argument("--model", default="embedded", help="the daemons' --model (embedded, default or a DIR)")
    parser.add_argument("--served-model-name", default=None, help="the model name requests carry (--token-ids)")
    parser.add_argument("--node-arg", action="append", default=[], help="one more flag for both daemons (repeat)")
    parser.add_argument("--token-ids", action="store_true",
                        help="random token-id prompts through /v1/completions (a model without a chat template)")
    parser.add_argument("--tier", choices=("file", "host"), default="file", help="the prefill node's tier with tiers on")
    parser.add_argument("--host-bytes", type=int, default=1 << 30, help="its --kv-host-bytes with --tier host")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the figures here")
    parser.add_argument("--pin", action="store_true",
                        help="the prefill node on CPU 0, the decode node on CPU 1 (proxy and client float)")
    args = parser.parse_args()
    if any("cuda" in a for a in args.node_arg):  # daemons of their own, not forks of a process holding torch
        os.environ.setdefault("PDSERVE_TEST_FORK", "0")
    base = system_prompt(args.system_tokens)
    systems = [f"Conversation {i}. {base}" for i in range(args.conversations)]
    working = args.conversations * (args.system_tokens + args.turns * (args.max_tokens + 20))
    off = run(False, args, systems)
    on = run(True, args, systems)
    report(on, off, args, working)


if __name__ == "__main__":
    main()
