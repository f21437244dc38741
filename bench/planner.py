"""The planner (``--planner on``) against fixed prefill:decode ratios on a workload whose phase shifts.

Four daemons (real processes, ``--model``: the embedded tiny model by default) behind one proxy,
split 1:3, 2:2 or 3:1 for good, or started 2:2 with the planner free to flip them. Each
configuration gets the same open-loop workload (Poisson arrivals, streamed, greedy), in phases of
``--phase-s`` seconds that alternate ``--phases`` times:

    long:  prompts of ``--long-prompt-tokens`` tokens, ``--long-max-tokens`` output tokens, at ``--long-rate``/s
    chat:  prompts of ``--chat-prompt-tokens`` tokens, ``--chat-max-tokens`` output tokens, at ``--chat-rate``/s

Every prompt is its own slice of Python's documentation (tokenized by the served model's
tokenizer) under a run-unique ``cache_salt``: no prefix cache makes a long prompt cheap. Reported
per phase kind and over the whole run: requests, SLO attainment (the share of requests whose TTFT
is within ``--slo-ttft-ms`` and whose mean inter-token gap is within ``--slo-itl-ms``, both at the
client; a failed request misses), TTFT and ITL p50/p99 (ITL over every gap), failed requests; for
the planner, its flips and their mean time without the drain (the daemons'
``pdserve:role_flip_seconds``) and drain. The last lines judge issue 36's goals: in each phase
within 5 points of attainment of the best fixed ratio for that phase, better than every fixed
ratio over the whole run, flips <= 1 s (drain apart), 0 failed requests.

On this CPU the four daemons share the machine's cores: a prefill node and a decode node are not
separate hardware, so a ratio changes how work is queued and batched, not how much compute each
phase gets; read the table with that in mind.

    flock /tmp/pdserve-bench.lock python bench/planner.py [--phase-s 20] [--phases 4]
        [--configs planner,1:3,2:2,3:1] [--long-rate 2] [--chat-rate 4] [--slo-ttft-ms 1000]
        [--slo-itl-ms 60] [--planner-arg=--planner-cooldown-s=5 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests"), str(ROOT / "bench")]

from adaptive import corpus  # noqa: E402
from common.defaults import DEFAULT_CACHE_DIR, EMBEDDED_MODEL_SPEC  # noqa: E402
from common.model.sources import resolve_model  # noqa: E402
from helpers.cluster import Proc, labelled, start, stop_all  # noqa: E402
from helpers.flippable import start_flippable  # noqa: E402
from helpers.stats import pct  # noqa: E402

PLANNER_DEFAULTS = ("--planner-interval-s", "1", "--planner-hysteresis", "2", "--planner-warmup-s", "3",
                    "--planner-cooldown-s", "5")


@dataclass
class Request:
    phase: str
    ok: bool = False
    ttft_s: float | None = None
    gaps_s: list[float] = field(default_factory=list)


@dataclass
class Workload:
    text: list[int]
    model: str
    salt: str
    args: argparse.Namespace

    def prompt(self, rng: random.Random, tokens: int) -> list[int]:
        at = rng.randrange(0, len(self.text) - tokens)
        return self.text[at:at + tokens]


def one(client: httpx.Client, url: str, work: Workload, prompt: list[int], max_tokens: int, record: Request) -> None:
    body = {"model": work.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "cache_salt": work.salt}
    t0 = time.perf_counter()
    times: list[float] = []
    try:
        with client.stream("POST", url + "/v1/completions", json=body) as response:
            if response.status_code != 200:
                return
            for line in response.iter_lines():
                if line.startswith("data: {") and any(c.get("text") for c in json.loads(line[6:])["choices"]):
                    times.append(time.perf_counter())
                if line.startswith("data: {") and '"error"' in line:
                    return
    except httpx.HTTPError:
        return
    if times:
        record.ok, record.ttft_s = True, times[0] - t0
        record.gaps_s = [b - a for a, b in zip(times, times[1:])]


def drive(url: str, work: Workload, seed: int) -> list[Request]:
    """The phased open-loop workload against ``url``; every request's record."""
    a = work.args
    rng = random.Random(seed)
    records: list[Request] = []
    client = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=512, max_keepalive_connections=512))
    with ThreadPoolExecutor(512) as pool:
        t0 = time.perf_counter()
        for index in range(a.phases):
            kind = "long" if index % 2 == 0 else "chat"
            rate, tokens, max_tokens = ((a.long_rate, a.long_prompt_tokens, a.long_max_tokens) if kind == "long"
                                        else (a.chat_rate, a.chat_prompt_tokens, a.chat_max_tokens))
            end, at = t0 + (index + 1) * a.phase_s, t0 + index * a.phase_s
            while (at := at + rng.expovariate(rate)) < end:
                time.sleep(max(0.0, at - time.perf_counter()))
                records.append(record := Request(kind))
                pool.submit(one, client, url, work, work.prompt(rng, tokens), max_tokens, record)
    client.close()
    return records


def start_cluster(tmp: Path, prefills: int, decodes: int, proxy_args: tuple[str, ...],
                  model_args: tuple[str, ...]) -> list[Proc]:
    procs = [start("proxy", tmp, "--disagg-policy", "always", *proxy_args, wait=False)]
    try:
        node = ("--proxy", f"127.0.0.1:{procs[0].kv_port}", "--heartbeat-interval-s", "0.5", "--drain-timeout-s",
                "10", *model_args)
        # pdserve prefill|decode (they can flip) for every configuration: the fixed ratios run the same daemons
        procs += [start_flippable("prefill", tmp, *node, name=f"p{i}") for i in range(prefills)]
        procs += [start_flippable("decode", tmp, *node, name=f"d{i}") for i in range(decodes)]
        for proc in procs[1:]:
            proc.wait_ready(timeout=300)
        procs[0].wait_ready(timeout=60)
        deadline = time.monotonic() + 30
        while httpx.get(procs[0].url + "/ready").json()["nodes"] != {"P": prefills, "D": decodes}:
            assert time.monotonic() < deadline, "not every daemon registered"
            time.sleep(0.2)
    except BaseException:
        stop_all(procs)
        raise
    return procs


def flip_figures(procs: list[Proc], proxy: Proc) -> dict[str, float]:
    """The planner's flips, and the daemons' flip and drain seconds (means over their histograms)."""
    out = {"flips": labelled(proxy.url, "pdserve:planner_actions_total", action="flip", outcome="ok")}
    for name in ("role_flip_seconds", "role_drain_seconds"):
        total = count = 0.0
        for proc in procs[1:]:
            text = httpx.get(proc.url + "/metrics", timeout=10).text
            for line in text.splitlines():
                if line.startswith(f"pdserve:{name}_sum"):
                    total += float(line.rsplit(" ", 1)[1])
                elif line.startswith(f"pdserve:{name}_count"):
                    count += float(line.rsplit(" ", 1)[1])
        out[name] = total / count if count else float("nan")
    return out


def figures(records: list[Request], args: argparse.Namespace) -> dict[str, float]:
    ttft = [r.ttft_s * 1000 for r in records if r.ok]
    gaps = [g * 1000 for r in records for g in r.gaps_s]
    within = [r for r in records if r.ok and r.ttft_s * 1000 <= args.slo_ttft_ms
              and (not r.gaps_s or sum(r.gaps_s) / len(r.gaps_s) * 1000 <= args.slo_itl_ms)]
    return {"requests": len(records), "attainment": len(within) / len(records) if records else float("nan"),
            "ttft_p50": pct(ttft, 0.5), "ttft_p99": pct(ttft, 0.99), "itl_p50": pct(gaps, 0.5),
            "itl_p99": pct(gaps, 0.99), "failed": sum(not r.ok for r in records)}


def run_config(name: str, args: argparse.Namespace, work: Workload, tmp: Path) -> dict:
    planner = name == "planner"
    prefills, decodes = (2, 2) if planner else map(int, name.split(":"))
    proxy_args = ("--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-itl-ms", str(args.slo_itl_ms))
    if planner:
        proxy_args += ("--planner", "on", *PLANNER_DEFAULTS, *args.planner_arg)
    run_dir = tmp / name.replace(":", "-")
    run_dir.mkdir()
    procs = start_cluster(run_dir, prefills, decodes, proxy_args, args.model_args)
    try:
        records = drive(procs[0].url, Workload(work.text, work.model, f"{work.salt}-{name}", args), args.seed)
        result = {kind: figures([r for r in records if r.phase == kind], args) for kind in ("long", "chat")}
        result["all"] = figures(records, args)
        result["nodes_at_end"] = httpx.get(procs[0].url + "/ready").json()["nodes"]
        if planner:
            result.update(flip_figures(procs, procs[0]))
        return result
    finally:
        stop_all(procs)


def report(results: dict[str, dict], args: argparse.Namespace) -> None:
    print(f"\nSLOs: TTFT {args.slo_ttft_ms:g} ms, ITL {args.slo_itl_ms:g} ms; {args.phases} phases of "
          f"{args.phase_s:g} s (long: {args.long_prompt_tokens} prompt / {args.long_max_tokens} output tokens at "
          f"{args.long_rate:g}/s; chat: {args.chat_prompt_tokens} / {args.chat_max_tokens} at {args.chat_rate:g}/s)")
    print(f"{'config':<8} {'phase':<5} {'reqs':>5} {'SLO %':>6} {'TTFT p50':>9} {'p99':>8} {'ITL p50':>8} "
          f"{'p99':>7} {'failed':>6}")
    for name, result in results.items():
        for kind in ("long", "chat", "all"):
            f = result[kind]
            print(f"{name:<8} {kind:<5} {f['requests']:>5} {100 * f['attainment']:>6.1f} {f['ttft_p50']:>9.1f} "
                  f"{f['ttft_p99']:>8.1f} {f['itl_p50']:>8.1f} {f['itl_p99']:>7.1f} {f['failed']:>6}")
    if "planner" in results:
        p = results["planner"]
        print(f"planner: {p['flips']:g} flips, flip {p['role_flip_seconds'] * 1000:.1f} ms mean without the drain, "
              f"drain {p['role_drain_seconds'] * 1000:.0f} ms mean; nodes at the end {p['nodes_at_end']}")
        judge(results)


def judge(results: dict[str, dict]) -> None:
    fixed = {k: v for k, v in results.items() if k != "planner"}
    if not fixed:
        return
    planner = results["planner"]
    for kind in ("long", "chat"):
        best_name = max(fixed, key=lambda k: fixed[k][kind]["attainment"])
        best, got = fixed[best_name][kind]["attainment"], planner[kind]["attainment"]
        verdict = "met" if got >= best - 0.05 else "NOT met"
        print(f"goal, {kind} phase within 5 points of the best fixed ratio ({best_name}, {100 * best:.1f} %): "
              f"planner {100 * got:.1f} % -> {verdict}")
    best_all = max(v["all"]["attainment"] for v in fixed.values())
    got = planner["all"]["attainment"]
    print(f"goal, whole run better than every fixed ratio (best {100 * best_all:.1f} %): planner {100 * got:.1f} % -> "
          f"{'met' if got > best_all else 'NOT met'}")
    flip = planner["role_flip_seconds"]
    print(f"goal, flip <= 1 s without the drain: {'met' if flip == flip and flip <= 1.0 else 'NOT met'} "
          f"({flip * 1000:.1f} ms mean over {planner['flips']:g})")
    failed = sum(r["all"]["failed"] for r in results.values())
    print(f"failed requests over every run: {failed}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=EMBEDDED_MODEL_SPEC)
    parser.add_argument("--configs", default="planner,1:3,2:2,3:1")
    parser.add_argument("--phase-s", type=float, default=20.0)
    parser.add_argument("--phases", type=int, default=4)
    parser.add_argument("--long-rate", type=float, default=2.0)
    parser.add_argument("--chat-rate", type=float, default=4.0)
    parser.add_argument("--long-prompt-tokens", type=int, default=1000)
    parser.add_argument("--long-max-tokens", type=int, default=4)
    parser.add_argument("--chat-prompt-tokens", type=int, default=32)
    parser.add_argument("--chat-max-tokens", type=int, default=96)
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=60.0)
    parser.add_argument("--planner-arg", action="append", default=[], help="more proxy flags for the planner run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--log-dir", type=Path, default=None, help="keep every process's log here (default: "
                        "a temporary directory, removed)")
    args = parser.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c != "planner" and (len(c.split(":")) != 2 or sum(map(int, c.split(":"))) != 4):
            parser.error(f"--configs: {c!r} is neither 'planner' nor P:D of four daemons")
    model_dir, served = resolve_model(args.model, DEFAULT_CACHE_DIR)
    args.model_args = ("--model", str(model_dir), "--served-model-name", served)
    work = Workload(corpus(model_dir), served, uuid.uuid4().hex, args)
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-planner-") as tmp:
        logs = args.log_dir or Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        for name in configs:
            print(f"running {name} ...", file=sys.stderr, flush=True)
            results[name] = run_config(name, args, work, logs)
    report(results, args)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
