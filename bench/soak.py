"""Soak: many mixed requests through proxy -> prefill -> decode; nothing may fail or leak.

Starts the three real processes on loopback with the embedded model (as `pdserve up` does,
on free ports), with a fresh cluster key (mode 0600) when the proxy has
``--cluster-key-file``. Sends a warm-up, samples each process's RSS, threads and open FDs,
then sends ``--requests`` requests at ``--concurrency``: completions and chat, streamed or
not, some clients that go away mid-answer (a stream closed after its first chunk, a
non-streaming request given up after a moment) and a few bad requests that must get a 4xx.
After each round (``--rounds``) it waits until both daemons hold no request and no KV
block and samples again, then prints a markdown table. Goals (issue 11): 0 failures, RSS
growth under 10 % after warm-up, threads and FDs back to their baseline.

    .venv/bin/python bench/soak.py [--requests 1000] [--concurrency 64] [--rounds 2] [--warmup 128]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve import launcher  # noqa: E402
from pdserve.run_dir import down, write_pids  # noqa: E402

MODEL = "pdserve-tiny"
WORDS = ("the quick brown fox jumps over a lazy dog while seven wizards quietly pack "
         "boxes of liquor and jugs near the river under a pale winter sky").split()
# kind -> weight (per 100 requests)
MIX = {"completion": 30, "completion_stream": 20, "chat": 20, "chat_stream": 15,
       "stream_disconnect": 6, "give_up": 4, "bad": 5}
BAD_BODIES: list[tuple[str, bytes]] = [
    ("/v1/completions", json.dumps({"model": "no-such-model", "prompt": "hi"}).encode()),
    ("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": -1}).encode()),
    ("/v1/completions", b'{"model": "pdserve-tiny", "prompt": '),  # cut-off JSON
    ("/v1/chat/completions", json.dumps({"model": MODEL}).encode()),  # no messages
    ("/v1/chat/completions", json.dumps({"model": MODEL, "temperature": "hot",
                                         "messages": [{"role": "user", "content": "hi"}]}).encode()),
]


# ---------------------------------------------------------------------------- processes

def free_ports(count: int) -> list[int]:
    import socket

    socks = [socket.socket() for _ in range(count)]
    for sock in socks:
        sock.bind(("127.0.0.1", 0))
    ports = [sock.getsockname()[1] for sock in socks]
    for sock in socks:
        sock.close()
    return ports


def proxy_has_cluster_key() -> bool:
    result = subprocess.run([sys.executable, "-m", "proxy", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    return "--cluster-key-file" in result.stdout


def write_cluster_key(path: Path) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    return path


def start_cluster(run_dir: Path, model: str | None, key_file: Path | None, timeout: float) -> list[dict]:
    """proxy, prefill, decode as `pdserve up` starts them (+ the key); their pids.json entries."""
    ports = free_ports(6)
    options = launcher.UpOptions(run_dir=run_dir, model=model, timeout=timeout,
                                 **dict(zip(launcher.PORT_FLAGS, ports)))
    key_args = ("--cluster-key-file", str(key_file)) if key_file else ()
    specs = [replace(s, args=(*s.args, *key_args))
             for s in launcher.process_specs(options, launcher.model_args(options))]
    log_dir = run_dir / "logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    procs, entries = [], []
    try:
        for spec in specs:
            procs.append(launcher.start_process(spec, log_dir))
            entries.append({"name": spec.name, "pid": procs[-1].pid, "port": spec.port,
                            "module": spec.module})
            write_pids(run_dir, entries)
        launcher.wait_ready(specs, procs, log_dir, timeout)
    except BaseException:
        down(run_dir, quiet=True)
        raise
    return entries


def process_sample(pid: int) -> dict[str, float]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kb = int(re.search(r"^VmRSS:\s+(\d+)", status, re.M).group(1))
    threads = int(re.search(r"^Threads:\s+(\d+)", status, re.M).group(1))
    return {"rss_mib": rss_kb / 1024, "threads": threads, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


async def metric(client: httpx.AsyncClient, port: int, name: str) -> float:
    text = (await client.get(f"http://127.0.0.1:{port}/metrics")).text
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{")]
    return sum(values)


async def wait_idle(entries: list[dict], deadline_s: float) -> bool:
    """Until both daemons run no request and hold no KV block; False if the deadline passes."""
    daemons = [e["port"] for e in entries if e["name"] != "proxy"]
    deadline = time.monotonic() + deadline_s
    async with httpx.AsyncClient(timeout=10) as client:
        while time.monotonic() < deadline:
            busy = 0.0
            for port in daemons:
                busy += await metric(client, port, "pdserve:num_requests_running")
                busy += await metric(client, port, "pdserve:kv_cache_usage_perc")
            if busy == 0:
                return True
            await asyncio.sleep(0.25)
    return False


def settle(entries: list[dict], baseline: dict[str, dict[str, float]], deadline_s: float) -> float:
    """Seconds until every process is back to its baseline threads and FDs, at most ``deadline_s``.

    Idle worker threads leave on their own timers (anyio's after 10 s idle, the control
    plane's peer links after ``peer_idle_s``): a sample taken the moment the daemons go idle
    counts them; one that waits for them does not, while a real leak never comes back.
    """
    t0 = time.monotonic()
    while time.monotonic() - t0 < deadline_s:
        now = {e["name"]: process_sample(e["pid"]) for e in entries}
        if all(now[n][k] <= baseline[n][k] for n in baseline for k in ("threads", "fds")):
            break
        time.sleep(0.5)
    return time.monotonic() - t0


# ---------------------------------------------------------------------------- load

def body_for(kind: str, rng: random.Random) -> tuple[str, dict]:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
    common = {"model": MODEL, "max_tokens": rng.randint(1, 24), "temperature": rng.choice([0, 0.8])}
    if kind.startswith("chat"):
        body = {**common, "messages": [{"role": "user", "content": prompt}]}
        return "/v1/chat/completions", body | {"stream": kind.endswith("stream")}
    stream = kind.endswith("stream") or kind == "stream_disconnect"
    return "/v1/completions", {**common, "prompt": prompt, "stream": stream}


async def one_request(client: httpx.AsyncClient, url: str, kind: str, rng: random.Random) -> str:
    """'ok', 'disconnected' (by us, on purpose) or the name of a failure."""
    if kind == "bad":
        path, raw = rng.choice(BAD_BODIES)
        r = await client.post(url + path, content=raw, headers={"Content-Type": "application/json"})
        if r.status_code >= 500:
            return status_failure(r.status_code)
        if r.status_code < 400:
            return f"bad request answered {r.status_code}"
        try:
            shape_ok = set(r.json()["error"]) >= {"message", "type", "param", "code"}
            return "ok" if shape_ok else "4xx body not OpenAI's"
        except (ValueError, KeyError, TypeError):
            return "4xx body not OpenAI's"
    path, body = body_for(kind, rng)
    if kind == "give_up":
        try:
            r = await asyncio.wait_for(client.post(url + path, json=body), timeout=rng.uniform(0.02, 0.3))
        except asyncio.TimeoutError:
            return "disconnected"
        return "ok" if r.status_code == 200 else status_failure(r.status_code)
    if not body["stream"]:
        r = await client.post(url + path, json=body)
        if r.status_code != 200:
            return status_failure(r.status_code)
        return "ok" if r.json()["usage"]["completion_tokens"] >= 1 else "empty answer"
    async with client.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return status_failure(r.status_code)
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                return "ok"
            if '"error"' in data and "error" in json.loads(data):
                return "stream error event"
            if kind == "stream_disconnect" and json.loads(data).get("choices"):
                return "disconnected"  # leaving the block closes the connection mid-stream
    return "stream without [DONE]"


def status_failure(status: int) -> str:
    return "5xx" if status >= 500 else f"unexpected {status}"


async def run_load(url: str, count: int, concurrency: int, seed: int) -> tuple[Counter, Counter, list[float]]:
    rng = random.Random(seed)
    kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=count)
    queue: asyncio.Queue[str] = asyncio.Queue()
    for kind in kinds:
        queue.put_nowait(kind)
    outcomes: Counter = Counter()
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300, connect=30), limits=limits) as client:

        async def worker(worker_rng: random.Random) -> None:
            while not queue.empty():
                kind = queue.get_nowait()
                t0 = time.perf_counter()
                try:
                    outcome = await one_request(client, url, kind, worker_rng)
                except httpx.TimeoutException:
                    outcome = "timeout"
                except (httpx.TransportError, ValueError, KeyError) as exc:
                    outcome = f"client saw {type(exc).__name__}"
                outcomes[outcome] += 1
                if outcome == "ok" and kind != "bad":
                    latencies.append(time.perf_counter() - t0)

        await asyncio.gather(*(worker(random.Random(rng.random())) for _ in range(concurrency)))
    return Counter(kinds), outcomes, latencies


# ---------------------------------------------------------------------------- report

def report(args: argparse.Namespace, key_on: bool, kinds: Counter, outcomes: Counter, latencies: list[float],
           seconds: float, idle: bool, samples: list[dict], settled: list[float]) -> str:
    failures = {k: v for k, v in outcomes.items() if k not in ("ok", "disconnected")}
    if not idle:
        failures["not idle after a round (requests or KV blocks held)"] = 1
    lat = sorted(latencies)
    p = (lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] * 1000) if lat else (lambda q: float("nan"))
    key = "on (--cluster-key-file, 0600, 32 random bytes)" if key_on else "off (flag not available)"
    mix = ", ".join(f"{k} {v}" for k, v in sorted(kinds.items()))
    failed = "".join(f"; {k}: {v}" for k, v in sorted(failures.items()))
    lines = [
        f"Soak: {args.requests} requests in {args.rounds} round(s) at concurrency {args.concurrency} after "
        f"{args.warmup} warm-up (embedded model, proxy -> prefill -> decode on loopback)", "",
        "| | |", "|---|---|",
        f"| cluster key | {key} |",
        f"| requests | {sum(kinds.values())}: {mix} |",
        f"| answered ok | {outcomes['ok']} |",
        f"| client went away on purpose | {outcomes['disconnected']} |",
        f"| failures | {sum(failures.values())}{failed} |",
        f"| wall time under load | {seconds:.1f} s ({sum(kinds.values()) / seconds:.1f} req/s) |",
        f"| latency of ok requests | p50 {p(0.5):.0f} ms, p99 {p(0.99):.0f} ms, "
        f"mean {statistics.fmean(lat) * 1000 if lat else float('nan'):.0f} ms |",
        f"| daemons idle after each round | {'yes' if idle else 'NO'} |", "",
        "Each process sampled after warm-up, then after each round once the daemons were idle and "
        "threads and FDs were back to the first sample (or --settle-timeout passed; it took "
        + ", ".join(f"{t:.1f} s" for t in settled) + "): a leak never comes back.", "",
        "| process | RSS (MiB) | RSS growth | threads | FDs |",
        "|---|---|---|---|---|",
    ]
    for name in samples[0]:
        series = [sample[name] for sample in samples]

        def arrow(key: str, fmt: str = "{:.0f}") -> str:
            return " → ".join(fmt.format(point[key]) for point in series)  # noqa: B023

        growth = (series[-1]["rss_mib"] - series[0]["rss_mib"]) / series[0]["rss_mib"] * 100
        lines.append(f"| {name} | {arrow('rss_mib')} | {growth:+.1f} % | {arrow('threads')} "
                     f"| {arrow('fds')} |")
    return "\n".join(lines)


def missed_goals(failures: int, samples: list[dict]) -> list[str]:
    """Issue 11's goals that this run missed (empty: all met)."""
    missed = [f"{failures} failures (goal 0)"] if failures else []
    for name in samples[0]:
        first, last = samples[0][name], samples[-1][name]
        growth = (last["rss_mib"] - first["rss_mib"]) / first["rss_mib"] * 100
        if growth >= 10:
            missed.append(f"{name}: RSS grew {growth:.1f} % (goal < 10 %)")
        for key in ("threads", "fds"):
            if last[key] > first[key]:
                missed.append(f"{name}: {key} {first[key]:.0f} -> {last[key]:.0f} (goal: back to baseline)")
    return missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="the requests are sent in this many rounds")
    parser.add_argument("--warmup", type=int, default=128, help="requests before the first sample")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    parser.add_argument("--start-timeout", type=float, default=300.0)
    parser.add_argument("--idle-timeout", type=float, default=60.0,
                        help="how long the daemons may take to release everything after a round")
    parser.add_argument("--settle-timeout", type=float, default=30.0,
                        help="how long idle worker threads and sockets may take to go after a round")
    args = parser.parse_args()

    kinds, outcomes, latencies, seconds, idle = Counter(), Counter(), [], 0.0, True
    settled: list[float] = []
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp:
        run_dir = Path(tmp)
        key_file = write_cluster_key(run_dir / "cluster.key") if proxy_has_cluster_key() else None
        entries = start_cluster(run_dir, args.model, key_file, args.start_timeout)
        url = f"http://127.0.0.1:{entries[0]['port']}"
        try:
            asyncio.run(run_load(url, args.warmup, args.concurrency, args.seed + 1))
            asyncio.run(wait_idle(entries, args.idle_timeout))
            samples = [{e["name"]: process_sample(e["pid"]) for e in entries}]
            for index in range(args.rounds):
                count = args.requests // args.rounds + (index < args.requests % args.rounds)
                t0 = time.perf_counter()
                k, o, lat = asyncio.run(run_load(url, count, args.concurrency, args.seed + 2 + index))
                seconds += time.perf_counter() - t0
                kinds, outcomes, latencies = kinds + k, outcomes + o, latencies + lat
                idle = asyncio.run(wait_idle(entries, args.idle_timeout)) and idle
                settled.append(settle(entries, samples[0], args.settle_timeout))
                samples.append({e["name"]: process_sample(e["pid"]) for e in entries})
        except BaseException:
            for entry in entries:
                tail = launcher.log_tail(run_dir / "logs" / f"{entry['name']}.log")
                print(f"--- {entry['name']} log tail ---\n{tail}", file=sys.stderr)
            raise
        finally:
            down(run_dir, quiet=True)
    print(report(args, key_file is not None, kinds, outcomes, latencies, seconds, idle, samples, settled))
    failures = sum(v for k, v in outcomes.items() if k not in ("ok", "disconnected")) + (not idle)
    missed = missed_goals(failures, samples)
    print("\nGoals (0 failures, RSS growth < 10 %, threads and FDs back to baseline): "
          + ("met" if not missed else "MISSED: " + "; ".join(missed)))
    sys.exit(1 if missed else 0)


if __name__ == "__main__":
    main()
