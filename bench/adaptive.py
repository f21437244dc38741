"""Adaptive disaggregation: ``--disagg-policy always`` vs ``never`` vs ``auto`` vs a colocated node.

One prefill and one decode daemon (real processes, CPU, one thread each) serve
three proxies: ``auto`` (the daemons register with it, so it sees their measured figures) and
``always`` / ``never`` (the same daemons as static nodes). The colocated node is one process
given two threads: the same two processes' worth of CPU. Each configuration runs the same mixed
workload at each rate (Poisson arrivals, streamed, greedy, ``--max-tokens`` output tokens each):
short prompts of 16-128 tokens and long ones of 1,500-3,000 tokens, half of the long ones
sharing a 1,000-token document. Every run sends the same prompts with its own ``cache_salt``,
so no run reuses another's prefix cache (within a run the shared document is cached: that is
the workload, not an artefact) and every policy generates the same tokens (a run-unique text
tag at the front of the prompts changed the outputs, and with them how many tokens came as
one streamed chunk: noise in ITL). Reported per run: TTFT p50/p99 and ITL p50/p99 at the client
(ms), output tokens/s over the run (tokens from ``usage``), KV bytes the decode daemon received,
and auto's local/remote split.

Beside that open-loop run, a closed-loop one (``--concurrency 1,16``) is what a load tool such
as AIPerf or guidellm does: C clients, each sending its next request when its last one ended,
every prompt ``--prompt-tokens`` long (256: uniform, no shared prefix) with
``--closed-max-tokens`` output tokens (64). It reports TTFT p50/p99, ITL p50, output tokens/s and
the share of requests ``auto`` prefilled remotely, by the decision's reason
(``pdserve:proxy_prefill_decisions_total``). ``--rates ''`` or ``--concurrency ''`` skips a run;
``--max-local-prefill-stall-ms`` sets the decode daemon's bound (the tiny model prefills 256 tokens
in ~25 ms, under the default 50 ms; a real model on CPU takes far longer, so ``auto`` sends them
remote by ``stall_bound``: 10 ms reproduces that); ``--no-colocated`` leaves the colocated node
out; ``--debug-decisions`` starts ``auto``'s proxy at debug level, so its log (path printed at the
end) holds every decision with its estimates.

``--model`` picks what the nodes serve: ``embedded`` (the default: the tiny random model),
``default`` (SmolLM2-135M-Instruct, as a node with no ``--model`` serves it), a directory or a
``.gguf``; every node gets ``--model DIR --served-model-name NAME`` and the prompts are that
model's tokens. The real model computes a long prompt in seconds on one CPU thread, not tens of
milliseconds: give it rates and a request count it can keep up with (e.g. ``--rates 0.1``).

Where the daemons run (``--layout``): a disaggregated cluster puts its prefill and decode nodes
on separate machines, and the decisions ``auto`` makes assume that (a local prefill on the
decode node costs the prefill node nothing). ``machines`` (the default, on two or more CPUs)
lays that out on this machine: the prefill daemon alone on CPU 0 (its machine); the decode
daemon, the proxies and this client on CPU 1 (the decode machine, which also carries the front
end); the colocated node on both. ``shared`` lets the scheduler put every process anywhere, as
``pdserve up`` does: then the client's and the proxies' threads land on the prefill node's CPU
whenever the decode node's is busy, which it is under ``auto`` (its local prefills), and a long
prompt's remote prefill pays for that.

With ``--repeats R`` every (rate, policy) runs R times, the repeats interleaved (all rates and
policies once, then again), and each figure is the median over its R runs: one 24-request run's
p99 is its slowest request, and two runs of the same policy differ by more than the goal's 5 %.
The last lines judge the goals on the tables: issue 21's on the open-loop one (``auto`` within
5 % of the better fixed policy on every figure: latencies at most 1.05x the lower, tokens/s at
least 0.95x the higher; and below both fixed policies on TTFT p99 or ITL p99 at the highest
rate), issue 31's on both (within 5 % on TTFT p50, TTFT p99 and output tokens/s).

    python bench/adaptive.py [--model embedded|default|DIR] [--rates 1,2,4] [--requests 24]
                             [--max-tokens 32] [--concurrency 1,16] [--closed-requests N]
                             [--prompt-tokens 256] [--closed-max-tokens 64] [--repeats 1]
                             [--layout machines|shared] [--max-local-prefill-stall-ms MS]
                             [--no-colocated] [--debug-decisions]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from itertools import count
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from common.defaults import DEFAULT_CACHE_DIR, EMBEDDED_MODEL_SPEC  # noqa: E402
from common.model.sources import resolve_model  # noqa: E402
from common.model.tokenizer import Tokenizer  # noqa: E402
from helpers.cluster import MODULES, Proc, free_port, metric, start  # noqa: E402
from helpers.stats import pct  # noqa: E402

# idle connections dropped before the servers drop them (nodes: 5 s): a request sent on one the server
# is closing fails with "Server disconnected without sending a response" (a run between policies idles)
HTTP = httpx.Client(timeout=600, limits=httpx.Limits(max_connections=128, max_keepalive_connections=128,
                                                     keepalive_expiry=2.0))


@dataclass
class Run:
    ttft_ms: list[float] = field(default_factory=list)
    itl_ms: list[float] = field(default_factory=list)
    output_tokens: int = 0
    seconds: float = 0.0
    kv_bytes: float = 0.0
    decisions: Counter = field(default_factory=Counter)  # auto's, by (path, reason)
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds over the run: "proxy", "registries"

    @property
    def local(self) -> float:
        return sum(n for (path, _), n in self.decisions.items() if path == "local")

    @property
    def remote(self) -> float:
        return sum(n for (path, _), n in self.decisions.items() if path != "local")


def corpus(model_dir: Path) -> list[int]:
    """Python's own documentation (pydoc's topics) as the served model's token ids: the prompts' text."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return Tokenizer.from_dir(model_dir).encode(" ".join(topics[k] for k in sorted(topics)))


def workload(text: list[int], n: int, seed: int) -> list[tuple[float, list[int]]]:
    """``n`` (arrival offset in units of 1/rate, prompt token ids from ``text``): 70 % short, 30 % long."""
    rng = random.Random(seed)
    document = text[:1000]
    # the mix exactly as stated, in a random order (a coin per request made seed 0's 24 requests
    # 13 short and 11 long: 54 %, not 70 %)
    num_long = round(0.3 * n)
    kinds = ["short"] * (n - num_long) + ["shared"] * (num_long // 2) + ["long"] * (num_long - num_long // 2)
    rng.shuffle(kinds)
    out, t = [], 0.0
    for kind in kinds:
        t += rng.expovariate(1.0)
        start_at = rng.randrange(1000, len(text) - 3000)
        if kind == "short":
            prompt = text[start_at:start_at + rng.randint(16, 128)]
        else:
            k = rng.randint(1500, 3000)
            prompt = document + text[start_at:start_at + k - 1000] if kind == "shared" else text[start_at:start_at + k]
        out.append((t, prompt))
    return out


def one(url: str, prompt: list[int], max_tokens: int, run: Run, salt: str, model: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "cache_salt": salt}
    t0 = time.perf_counter()
    times, tokens = [], 0
    with HTTP.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if any(c.get("text") for c in chunk["choices"]):  # what a client sees: text, as vLLM's bench
                times.append(time.perf_counter())
            tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
    run.ttft_ms.append((times[0] - t0) * 1000)
    run.itl_ms += [(b - a) * 1000 for a, b in zip(times, times[1:])]
    run.output_tokens += tokens


def measure(url: str, decode: Proc | None, proxy: Proc | None, rate: float, args: argparse.Namespace,
            salt: str) -> Run:
    run = Run()
    jobs = workload(args.text, args.requests, args.seed)
    kv0 = metric(decode.url, "pdserve:kv_transfer_bytes_total") if decode else 0.0
    decisions0 = decisions(proxy) if proxy else Counter()
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(jobs)) as pool:
        futures = []
        for offset, prompt in jobs:
            time.sleep(max(0.0, t0 + offset / rate - time.perf_counter()))
            futures.append(pool.submit(one, url, prompt, args.max_tokens, run, salt, args.served_name))
        for f in futures:
            f.result()
    run.seconds = time.perf_counter() - t0
    return finish(run, decode, kv0, proxy, decisions0)


def uniform_prompts(text: list[int], n: int, length: int, seed: int) -> list[list[int]]:
    """``n`` prompts of ``length`` tokens each from ``text``, at random offsets."""
    rng = random.Random(seed)
    return [text[(at := rng.randrange(1000, len(text) - length)):at + length] for _ in range(n)]


def measure_closed(url: str, decode: Proc | None, proxy: Proc | None, concurrency: int,
                   args: argparse.Namespace, salt: str) -> Run:
    """``concurrency`` clients, each sending its next prompt as soon as its last answer ended."""
    run = Run()
    prompts = uniform_prompts(args.text, args.closed_requests or max(16, 4 * concurrency), args.prompt_tokens,
                              args.seed)
    kv0 = metric(decode.url, "pdserve:kv_transfer_bytes_total") if decode else 0.0
    decisions0 = decisions(proxy) if proxy else Counter()
    turn = count()  # next() on it is atomic under the GIL: each prompt goes to exactly one client

    def client() -> None:
        while (i := next(turn)) < len(prompts):
            one(url, prompts[i], args.closed_max_tokens, run, salt, args.served_name)

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for f in [pool.submit(client) for _ in range(concurrency)]:
            f.result()
    run.seconds = time.perf_counter() - t0
    return finish(run, decode, kv0, proxy, decisions0)


def finish(run: Run, decode: Proc | None, kv0: float, proxy: Proc | None, decisions0: Counter) -> Run:
    """The KV bytes the decode node received and ``auto``'s decisions during ``run``."""
    if decode:
        run.kv_bytes = metric(decode.url, "pdserve:kv_transfer_bytes_total") - kv0
    if proxy:
        run.decisions = decisions(proxy) - decisions0
    return run


def decisions(proxy: Proc) -> Counter:
    """The proxy's ``pdserve:proxy_prefill_decisions_total`` by (path, reason)."""
    out: Counter = Counter()
    for line in HTTP.get(proxy.url + "/metrics").text.splitlines():
        if line.startswith("pdserve:proxy_prefill_decisions_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            out[labels["path"], labels["reason"]] += float(line.rsplit(" ", 1)[1])
    return out


def cpu_seconds(proc: Proc) -> float:
    """User + system CPU seconds ``proc`` has used so far (/proc)."""
    fields = Path(f"/proc/{proc.popen.pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pin(proc: Proc | None, cpus: set[int]) -> None:
    """Every thread of ``proc`` (this process for None) onto ``cpus``; threads it starts later
    inherit it."""
    pid = os.getpid() if proc is None else proc.popen.pid
    for task in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(task), cpus)


def start_threads(role: str, tmp: Path, threads: int, *args: str) -> Proc:
    """``helpers.cluster.start`` for a colocated node with ``threads`` compute threads."""
    port = free_port()
    log = tmp / f"{role}-{threads}t.log"
    cmd = [sys.executable, "-m", MODULES[role], "serve", "--port", str(port), *args]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS=str(threads))
    with open(log, "wb") as out:
        popen = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                 start_new_session=True)
    proc = Proc(role, popen, port, log)
    proc.wait_ready()
    return proc


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=EMBEDDED_MODEL_SPEC,
                    help="what the nodes serve: embedded (the tiny random model, default), default "
                         "(SmolLM2-135M-Instruct), a Hugging Face directory or a .gguf")
    ap.add_argument("--rates", default="1,2,4", help="open loop: request rates (requests/s), comma-separated")
    ap.add_argument("--requests", type=int, default=24, help="open loop: requests per run")
    ap.add_argument("--max-tokens", type=int, default=32, help="open loop: output tokens per request")
    ap.add_argument("--concurrency", default="1,16", help="closed loop: client counts, comma-separated")
    ap.add_argument("--closed-requests", type=int, default=0,
                    help="closed loop: requests per run (default 4 per client, at least 16)")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="closed loop: tokens per prompt")
    ap.add_argument("--closed-max-tokens", type=int, default=64, help="closed loop: output tokens per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=1, help="runs per (load, policy); figures are their medians")
    ap.add_argument("--layout", choices=("machines", "shared"), default="machines",
                    help="machines: the prefill daemon alone on CPU 0, everything else on CPU 1; "
                         "shared: no pinning")
    ap.add_argument("--max-local-prefill-stall-ms", type=float, default=None,
                    help="the decode daemon's bound (its default when unset); a lower one puts the tiny model's "
                         "256-token prompts over it, as a real model's slower prefill does")
    ap.add_argument("--no-colocated", dest="colocated", action="store_false", help="leave the colocated node out")
    ap.add_argument("--debug-decisions", action="store_true", help="auto's proxy logs every decision (debug level)")
    ap.add_argument("--registry-always", action="store_true",
                    help="also `always` on a second registry proxy (the nodes register with both, and send both "
                         "their KV events), beside the static one: tells auto's own cost from a registry proxy's")
    args = ap.parse_args()
    if args.layout == "machines" and not (hasattr(os, "sched_setaffinity") and {0, 1} <= os.sched_getaffinity(0)):
        sys.exit("--layout machines needs CPUs 0 and 1 (Linux); use --layout shared")
    loads = [("rate", float(r)) for r in args.rates.split(",") if r] + \
            [("concurrency", float(c)) for c in args.concurrency.split(",") if c]
    model_dir, args.served_name = resolve_model(None if args.model == "default" else args.model, DEFAULT_CACHE_DIR)
    args.text = corpus(model_dir)
    model_args = ("--model", str(model_dir), "--served-model-name", args.served_name)
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-adaptive-"))
    procs: list[Proc] = []
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so the daemons are stopped on kill too
    try:
        auto = start("proxy", tmp, *(("--log-level", "debug") if args.debug_decisions else ()), wait=False)
        procs.append(auto)
        registries = [auto]
        if args.registry_always:
            registries.append(start("proxy", tmp, "--disagg-policy", "always", name="proxy-always-registry",
                                    wait=False))
            procs.append(registries[-1])
        to_proxies = ",".join(f"127.0.0.1:{r.kv_port}" for r in registries)
        p = start("prefill", tmp, *model_args, "--proxy", to_proxies, "--heartbeat-interval-s", "0.5")
        stall = () if args.max_local_prefill_stall_ms is None else (
            "--max-local-prefill-stall-ms", str(args.max_local_prefill_stall_ms))
        d = start("decode", tmp, *model_args, *stall, "--proxy", to_proxies, "--heartbeat-interval-s", "0.5")
        procs += [p, d]
        for registry in registries:
            registry.wait_ready()
        statics = ("--static-prefill", f"127.0.0.1:{p.port}@{p.kv_addr}", "--static-decode",
                   f"127.0.0.1:{d.port}@{d.kv_addr}")
        always = start("proxy", tmp, *statics, "--disagg-policy", "always", name="proxy-always")
        never = start("proxy", tmp, *statics, "--disagg-policy", "never", name="proxy-never")
        procs += [always, never]
        configs = [("always", always, d), ("never", never, d), ("auto", auto, d)]
        if args.registry_always:
            configs.insert(1, ("always (registry)", registries[1], d))
        if args.colocated:
            both = start_threads("both", tmp, 2, *model_args)
            procs.append(both)
            configs.append(("colocated (2 threads)", both, None))
        if args.layout == "machines":
            pin(p, {0})
            for proc in (d, *registries, always, never, None):
                pin(proc, {1})
            if args.colocated:
                pin(both, {0, 1})
        warm = workload(args.text, 6, 99)
        for _, proxy, _ in configs:  # pairs built, first-call costs paid, rates measured: unmeasured
            for _, prompt in warm:
                one(proxy.url, prompt, 4, Run(), f"warm {uuid.uuid4().hex}", args.served_name)
        runs: dict[tuple[str, float, str], list[Run]] = {}
        for repeat in range(args.repeats):
            for kind, x in loads:
                for name, proxy, decode in configs:
                    salt = f"run {uuid.uuid4().hex}"
                    counted = proxy if name == "auto" else None
                    # the proxy's own CPU, and the registries' (their KV events and heartbeats run in every run)
                    watched = {"proxy": [proxy], "registries": [r for r in registries if r is not proxy]}
                    cpu0 = {k: sum(cpu_seconds(q) for q in qs) for k, qs in watched.items()}
                    run = (measure(proxy.url, decode, counted, x, args, salt) if kind == "rate" else
                           measure_closed(proxy.url, decode, counted, int(x), args, salt))
                    run.cpu_s = {k: sum(cpu_seconds(q) for q in qs) - cpu0[k] for k, qs in watched.items()}
                    runs.setdefault((kind, x, name), []).append(run)
                    print(f"repeat {repeat + 1}, {kind} {x:g}: {name} done", file=sys.stderr)
        report(runs, args)
        if args.debug_decisions:
            print(f"\nauto's decisions: {auto.log}")
    finally:
        for proc in reversed(procs):
            proc.stop()


FIGURES = ("TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "output tok/s")  # all but tok/s: lower is better
ISSUE_31 = ("TTFT p50", "TTFT p99", "output tok/s")


def figures(r: Run) -> dict[str, float]:
    return {"TTFT p50": pct(r.ttft_ms, .5), "TTFT p99": pct(r.ttft_ms, .99), "ITL p50": pct(r.itl_ms, .5),
            "ITL p99": pct(r.itl_ms, .99), "output tok/s": r.output_tokens / r.seconds,
            "KV MiB": r.kv_bytes / 2**20, "local": r.local, "remote": r.remote,
            "proxy CPU ms/req": r.cpu_s.get("proxy", 0.0) * 1e3 / max(len(r.ttft_ms), 1),
            "registries CPU ms/req": r.cpu_s.get("registries", 0.0) * 1e3 / max(len(r.ttft_ms), 1)}


def split(rs: list[Run]) -> str:
    """``auto``'s decisions over all of ``rs``: the share sent remote and the reasons' shares."""
    total: Counter = sum((r.decisions for r in rs), Counter())
    n = sum(total.values())
    if not n:
        return ""
    reasons = ", ".join(f"{reason} {k / n:.0%}" for (_, reason), k in total.most_common())
    return f"{sum(k for (path, _), k in total.items() if path != 'local') / n:.0%} remote ({reasons})"


def report(runs: dict[tuple[str, float, str], list[Run]], args: argparse.Namespace) -> None:
    table = {key: {k: statistics.median(figures(r)[k] for r in rs) for k in figures(rs[0])}
             for key, rs in runs.items()}
    runs_per_row = f"{'the median of ' + str(args.repeats) + ' runs' if args.repeats > 1 else 'one run'} per row"
    open_loop = {(x, name): f for (kind, x, name), f in table.items() if kind == "rate"}
    closed_loop = {(x, name): f for (kind, x, name), f in table.items() if kind == "concurrency"}
    if open_loop:
        print(f"\nOpen loop: {args.requests} requests per run, {args.max_tokens} output tokens each, 70 % short "
              f"(16-128 tokens), 30 % long (1,500-3,000; half share a 1,000-token document); {args.served_name}, "
              f"CPU; {runs_per_row}; layout {args.layout}\n")
        print("| rate (req/s) | policy | TTFT p50 | TTFT p99 | ITL p50 | ITL p99 | output tok/s | KV moved | "
              "auto local/remote |")
        print("|---|---|---|---|---|---|---|---|---|")
        for (rate, name), f in open_loop.items():
            local_remote = f"{f['local']:.0f}/{f['remote']:.0f}" if name == "auto" else ""
            kv = f"{f['KV MiB']:.1f} MiB" if not name.startswith("colocated") else "-"
            print(f"| {rate:g} | {name} | {f['TTFT p50']:.0f} ms | {f['TTFT p99']:.0f} ms | {f['ITL p50']:.1f} ms | "
                  f"{f['ITL p99']:.1f} ms | {f['output tok/s']:.1f} | {kv} | {local_remote} |")
        print()
        for line in judge(open_loop) + judge(open_loop, ISSUE_31, "issue 31's", "req/s"):
            print(line)
    if closed_loop:
        print(f"\nClosed loop: {args.prompt_tokens}-token prompts, {args.closed_max_tokens} output tokens each, "
              f"{args.closed_requests or '4 per client (at least 16)'} requests per run; {args.served_name}, CPU; "
              f"{runs_per_row}; layout {args.layout}\n")
        print("| clients | policy | TTFT p50 | TTFT p99 | ITL p50 | output tok/s | KV moved | proxy CPU / request "
              "(other registries) | auto's decisions |")
        print("|---|---|---|---|---|---|---|---|---|")
        for (c, name), f in closed_loop.items():
            kv = f"{f['KV MiB']:.1f} MiB" if not name.startswith("colocated") else "-"
            decided = split(runs["concurrency", c, name]) if name == "auto" else ""
            cpu = f"{f['proxy CPU ms/req']:.2f} ms ({f['registries CPU ms/req']:.2f})"
            print(f"| {c:g} | {name} | {f['TTFT p50']:.0f} ms | {f['TTFT p99']:.0f} ms | {f['ITL p50']:.1f} ms | "
                  f"{f['output tok/s']:.1f} | {kv} | {cpu} | {decided} |")
        print()
        for line in judge(closed_loop, ISSUE_31, "issue 31's", "clients"):
            print(line)


def judge(table: dict[tuple[float, str], dict[str, float]], keys: tuple[str, ...] = FIGURES,
          goal: str = "issue 21's", unit: str = "req/s") -> list[str]:
    """A goal, figure by figure: the misses, then the verdict. Issue 21's (the default) also wants
    auto below both fixed policies on TTFT p99 or ITL p99 at the highest load."""
    loads = sorted({x for x, _ in table})
    misses = []
    for x in loads:
        auto, always, never = (table.get((x, n)) for n in ("auto", "always", "never"))
        if not (auto and always and never):
            continue
        for k in keys:
            if k == "output tok/s":
                best = max(always[k], never[k])
                ok = auto[k] >= 0.95 * best
            else:
                best = min(always[k], never[k])
                ok = auto[k] <= 1.05 * best
            if not ok:
                misses.append(f"- {x:g} {unit}, {k}: auto {auto[k]:.1f} against the better fixed policy's "
                              f"{best:.1f} ({auto[k] / best - 1:+.0%})")
    verdict = f"{goal} goal {{}}: auto within 5 % of the better fixed policy on {', '.join(keys)} ({len(misses)} misses)"
    if keys != FIGURES:
        return [verdict.format("met" if not misses else "not met") + ".", *misses]
    top = loads[-1]
    auto, always, never = (table.get((top, n), {}) for n in ("auto", "always", "never"))
    beats = [k for k in ("TTFT p99", "ITL p99") if auto and always and never and auto[k] < min(always[k], never[k])]
    met = not misses and bool(beats)
    return [verdict.format("met" if met else "not met") + f", and below both at {top:g} {unit} on "
            f"{', '.join(beats) if beats else 'neither TTFT p99 nor ITL p99'}.", *misses]


if __name__ == "__main__":
    main()
