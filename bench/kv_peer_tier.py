"""The peer tier (``--kv-peer-fetch on``): a conversation's next turn on another node than its last.

Starts a proxy, one prefill node and two decode nodes (real processes, CPU, loopback), every prompt
prefilled on its decode node (``--disagg-policy never``), three times:

- ``round_robin``, peer tier off: turns alternate decode nodes, so each turn finds its
  conversation's prefix on the other node, and computes it again;
- ``round_robin``, peer tier on: the proxy's hint names the node that holds it, and the turn's node
  fetches those blocks instead of computing them;
- ``prefix_aware``, peer tier off: the proxy sends each turn to the node that holds its prefix
  (the reference: what routing alone can do when the holder has room).

Each of ``--conversations`` conversations (an odd count, so that round robin alternates each one's
nodes) has a system prompt of its own and runs ``--turns`` turns, each resending the whole history,
one at a time. Prints per run: the decode nodes' pool hit rate and peer-tier hit rate over prompt
tokens looked up, TTFT p50/p99 of turns >= 2, output tokens/s, and whether the answers equal the
first run's.

    python bench/kv_peer_tier.py [--model embedded|default] [--conversations 5] [--turns 4] [--system-tokens 1000]

``--model default`` serves the product's default model (SmolLM2-135M-Instruct, 30 layers), whose
prefill costs what a real model's does on this CPU; ``embedded`` (4 layers) prefills so cheaply
that fetching barely pays.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from bench.kv_tiers import HTTP, RunResult, chat_turn  # noqa: E402
from bench.prefix_cache import QUESTIONS, system_prompt, wait_registered  # noqa: E402
from helpers.cluster import Proc, labelled, metric, start  # noqa: E402
from helpers.stats import pct  # noqa: E402

BLOCK_SIZE = 16
RUNS = (("round_robin", "off"), ("round_robin", "on"), ("prefix_aware", "off"))


def counters(decodes: list[Proc]) -> dict[str, float]:
    out = {"queries": 0.0, "hits": 0.0, "peer_blocks": 0.0}
    for d in decodes:
        out["queries"] += metric(d.url, "pdserve:prefix_cache_queries_total")
        out["hits"] += metric(d.url, "pdserve:prefix_cache_hits_total")
        out["peer_blocks"] += labelled(d.url, "pdserve:kv_tier_hits_total", tier="peer")
    return out


def run(policy: str, peer: str, args: argparse.Namespace, systems: list[str]) -> RunResult:
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-kv-peer-"))
    # the tokenizer: the proxy matches a chat prompt's blocks against the nodes' KV events by its token ids
    proxy_args = ["--policy", policy, "--disagg-policy", "never", "--tokenizer", args.tokenizer]
    proxy = start("proxy", tmp, *proxy_args, wait=False)
    model = ["--model", "embedded"] if args.model == "embedded" else []
    common = [*model, "--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5",
              "--block-size", str(BLOCK_SIZE), "--kv-peer-fetch", peer, "--kv-tier-load", args.kv_tier_load]
    procs: list[Proc] = [proxy]
    try:
        procs.append(start("prefill", tmp, *common, name="prefill", wait=False))
        decodes = [start("decode", tmp, *common, name=f"decode{i}", wait=False) for i in (1, 2)]
        procs += decodes
        for proc in procs[1:] + [proxy]:
            proc.wait_ready(timeout=300)
        wait_registered(proxy, 1)
        if peer == "on":
            deadline = time.monotonic() + 60
            while min(metric(d.url, "pdserve:kv_peers") for d in decodes) < 1:
                assert time.monotonic() < deadline, "the decode nodes never heard of their peers"
                time.sleep(0.2)
        name = HTTP.get(proxy.url + "/v1/models").json()["data"][0]["id"]
        for _ in range(2):  # each decode node's first-call costs
            chat_turn(proxy.url, [{"role": "user", "content": "warm up"}], 2, model=name)
        before = counters(decodes)
        result = RunResult()
        histories = [[{"role": "system", "content": s}] for s in systems]
        started = time.perf_counter()
        for turn in range(args.turns):
            for i, messages in enumerate(histories):
                messages.append({"role": "user", "content": QUESTIONS[(i + turn) % len(QUESTIONS)]})
                ttft, _, answer, tokens = chat_turn(proxy.url, messages, args.max_tokens, model=name)
                if turn:
                    result.ttft_ms.append(ttft * 1000)
                result.answers[(i, turn)] = answer
                result.output_tokens += tokens
                messages.append({"role": "assistant", "content": answer})
        result.seconds = time.perf_counter() - started
        after = counters(decodes)
        result.counters = {k: after[k] - before[k] for k in after}
        return result
    finally:
        for proc in reversed(procs):
            proc.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("embedded", "default"), default="embedded")
    parser.add_argument("--conversations", type=int, default=5, help="odd: round robin alternates each one's nodes")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=1000)
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per answer")
    parser.add_argument("--kv-tier-load", choices=("auto", "always"), default="always",
                        help="the decode nodes' --kv-tier-load (auto: fetch only while measured cheaper than computing)")
    args = parser.parse_args()
    from common.defaults import DEFAULT_CACHE_DIR, EMBEDDED_MODEL_SPEC
    from common.model.sources import resolve_model

    # the nodes' own model directory: the proxy must render and tokenize a chat prompt as they do
    spec = EMBEDDED_MODEL_SPEC if args.model == "embedded" else None
    args.tokenizer = str(resolve_model(spec, DEFAULT_CACHE_DIR)[0])
    base = system_prompt(args.system_tokens)
    systems = [f"Conversation {i}. {base}" for i in range(args.conversations)]
    results = {(policy, peer): run(policy, peer, args, systems) for policy, peer in RUNS}
    first = results[RUNS[0]]
    print(f"\n{args.conversations} conversations x {args.turns} turns, one request at a time, "
          f"{args.system_tokens}-token system prompt each, {args.max_tokens} tokens per answer; proxy + 2 decode "
          f"nodes prefilling locally (--disagg-policy never), model {args.model}, CPU fp32, loopback, "
          f"--kv-tier-load {args.kv_tier_load}\n")
    print("| routing | peer tier | pool hit rate | peer-tier hit rate | TTFT p50 ms (turns>=2) | TTFT p99 ms "
          "| output tok/s | answers equal run 1 |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for (policy, peer), r in results.items():
        c = r.counters
        queries = max(c["queries"], 1)
        peer_tokens = c["peer_blocks"] * BLOCK_SIZE
        same = sum(r.answers[k] == first.answers.get(k) for k in r.answers)
        print(f"| {policy} | {peer} | {(c['hits'] - peer_tokens) / queries:.1%} | {peer_tokens / queries:.1%} "
              f"| {statistics.median(r.ttft_ms):.1f} | {pct(r.ttft_ms, 0.99):.1f} "
              f"| {r.output_tokens / r.seconds:.1f} | {same}/{len(r.answers)} |")
    off, on = results[RUNS[0]], results[RUNS[1]]
    print(f"\nround robin, TTFT p50 of turns >= 2, peer tier off / on: "
          f"{statistics.median(off.ttft_ms) / statistics.median(on.ttft_ms):.2f}x")


if __name__ == "__main__":
    main()
