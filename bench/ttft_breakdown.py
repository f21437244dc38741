"""Time to first token for a long prompt: disaggregated (prefill -> decode) vs colocated.

Starts a colocated node, a prefill daemon and a decode daemon (real processes; the embedded
model on CPU unless told otherwise; KV over the default data plane) and sends a 2,000-token
prompt, each path a fresh one, over one kept-alive HTTP client (as the proxy's legs are).
``--model`` picks the weights: ``embedded`` (the default), ``default`` (SmolLM2-135M-Instruct,
as a node with no ``--model`` serves it), a directory or a ``.gguf``; every node gets
``--model DIR --served-model-name NAME``. The prompt is random token ids through
``/v1/completions``, or with ``--chat`` a user message of prose about that long through
``/v1/chat/completions`` (a fresh ``cache_salt`` each time, so no node reuses another round's
KV). After the rounds it reads each node's resident memory (``VmRSS``, and its peak
``VmHWM``) from /proc: issue 29's goal is at most 1.5 GB for one node serving SmolLM2 on CPU.
Breakdown for the prefill-first order:

- prefill compute: the prefill leg's latency (HTTP + tokenize + prefill + first token);
- transfer: the decode node's ``kv_transfer_seconds`` for the request (PULL to DONE);
- handoff: the rest of the decode leg's time to first token (HTTP, allocation,
  handshake, appending the first token, streaming it).

Also the concurrent order (both legs at once, the proxy's default) end to end, and each
disaggregated TTFT over the colocated one of the same round (median of those ratios).

With ``--itl`` it also measures the inter-token gaps of a request decoding on D while another
prompt's KV arrives there (issue 10: ITL unchanged while a 2,000-token prompt's KV lands).
On a GPU machine, ``--shape llama3.1-8b`` serves a random-weight checkpoint of that shape
(made on the GPU, as bench/gpu_engine.py does) and ``--node-arg`` passes each node its flags,
e.g. one GPU shared by the three nodes:

    python bench/ttft_breakdown.py [--model embedded|default|DIR] [--chat] [--prompt-tokens 2000]
        [--repeats 5] [--itl]
    python bench/ttft_breakdown.py --shape llama3.1-8b --itl --node-arg=--device=cuda \
        --node-arg=--gpu-memory-utilization=0.28 --node-arg=--kv-transport=cuda_ipc

Parity (issue 18): ``--parity N`` sends N greedy requests through the prefill -> decode pair
(both legs at once, as the proxy does) and compares each answer with the colocated node's,
token for token (a ``--shape`` checkpoint's tokenizer names every id). ``--up-parity N``
stops the three nodes, starts ``pdserve up`` on the same model (proxy + both daemons, on a
GPU each with the launcher's ``--gpu-memory-utilization`` share; ``--up-env`` sets their
``PDSERVE_*`` options, e.g. ``PDSERVE_KV_TRANSPORT=cuda_ipc``) and compares N requests sent
through its proxy. ``--decode-gpu I`` shows the decode daemon only GPU I (a pair across two
GPUs). ``--json PATH`` writes every figure; a parity mismatch makes the exit code 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from pdserve.launcher import PORT_FLAGS  # noqa: E402
from common.defaults import DEFAULT_CACHE_DIR, EMBEDDED_MODEL_SPEC  # noqa: E402
from common.request_id import make_request_id  # noqa: E402
from helpers.cluster import Proc, free_port, metric, start  # noqa: E402


# One client, connections kept alive, as the proxy's: a new httpx client per request costs
# 25-60 ms here (it loads the CA bundle), which the disaggregated path would pay twice.
HTTP = httpx.Client(timeout=120)


def route(body: dict) -> str:
    return "/v1/chat/completions" if "messages" in body else "/v1/completions"


def is_token_event(chunk: dict) -> bool:
    """A chunk carrying a token: any completions choice; a chat delta with logprobs (asked for, so a
    token whose text is still empty counts too), not the opening role delta."""
    return any("delta" not in c or c.get("logprobs") for c in chunk.get("choices", ()))


def token_times(url: str, body: dict, request_id: str | None, times: list[float]) -> None:
    """Stream one request to its end, appending perf_counter() of each token event to ``times``."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    with HTTP.stream("POST", url + route(body), json={**body, "stream": True}, headers=headers) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {") and is_token_event(json.loads(line[6:])):
                times.append(time.perf_counter())


def first_token_s(url: str, body: dict, request_id: str | None = None) -> float:
    """Seconds from sending a streaming request to its first token event (read to the end:
    the request must finish before the next)."""
    times: list[float] = []
    t0 = time.perf_counter()
    token_times(url, body, request_id, times)
    if not times:
        raise RuntimeError("no token")
    return times[0] - t0


def prefill_leg_s(prefill: Proc, body: dict, rid: str, usage: dict | None = None) -> float:
    """Seconds the prefill leg takes; its ``usage`` is copied into ``usage`` when given."""
    t0 = time.perf_counter()
    r = HTTP.post(prefill.url + route(body), json={**body, "max_tokens": 1, "stream": False},
                  headers={"X-Request-Id": rid}, timeout=600)
    r.raise_for_status()
    elapsed = time.perf_counter() - t0
    if usage is not None:
        usage.update(r.json()["usage"])
    return elapsed


def transfer_sum(decode: Proc) -> float:
    return metric(decode.url, "pdserve:kv_transfer_seconds_sum")


def transfer_bytes(decode: Proc) -> float:
    return metric(decode.url, "pdserve:kv_transfer_bytes_total")


def kv_megabytes(prompt_tokens: int) -> float:
    """The embedded model's KV for a prompt: 4 layers x K,V x 2 KV heads x head_dim 64, fp32."""
    return 4 * 2 * prompt_tokens * 2 * 64 * 4 / 1e6


PARTS = ("colocated", "prefill", "transfer", "handoff", "pf_total", "concurrent", "pf_ratio", "concurrent_ratio",
         "kv_mb", "transfer_gbps", "prompt_tokens")


def pair_transport(decode_url: str) -> str:
    """The data plane the decode node's live pairs use (``kv_pairs{transport}``), e.g. "tcp"."""
    text = HTTP.get(decode_url + "/metrics", timeout=10).text
    live = re.findall(r'^pdserve:kv_pairs\{[^}]*transport="([^"]+)"[^}]*\} ([0-9.]+)', text, re.M)
    return ", ".join(sorted({t for t, n in live if float(n) > 0})) or "none"


class Prompts:
    """Fresh prompts of about ``tokens`` tokens: no node's prefix cache holds one, so every token
    is computed and moved. Random ids as a completion, or (``prose``: token ids of English text,
    from the served model's tokenizer) a chat user message of that text, from a random offset,
    under its own ``cache_salt`` (the chat template's fixed start is not reused either)."""

    def __init__(self, tokens: int, rng: random.Random, prose: list[int] | None = None, tokenizer=None) -> None:
        self.tokens, self.rng, self.prose, self.tokenizer = tokens, rng, prose, tokenizer

    def fresh(self) -> dict:
        body = {"max_tokens": 2, "temperature": 0, "ignore_eos": True}
        if self.prose is None:
            return {**body, "prompt": [self.rng.randrange(4, 2048) for _ in range(self.tokens)]}
        start_at = self.rng.randrange(0, len(self.prose) - self.tokens)
        text = self.tokenizer.decode(self.prose[start_at:start_at + self.tokens])
        return {**body, "messages": [{"role": "user", "content": text}], "logprobs": True,
                "cache_salt": uuid.uuid4().hex}


def english_tokens(tokenizer) -> list[int]:
    """Python's own documentation (pydoc's topics), as token ids: prose and code, a few 100k tokens."""
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return tokenizer.encode(" ".join(topics[k] for k in sorted(topics)), add_special_tokens=False)


def sample(both: Proc, prefill: Proc, decode: Proc, prompts: Prompts) -> dict[str, float]:
    """One round: ms of each part in ``PARTS``, each path on a prompt no node has seen."""
    body = prompts.fresh()
    colocated = first_token_s(both.url, body)
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)
    usage: dict = {}
    p = prefill_leg_s(prefill, body, rid, usage)
    before, before_bytes = transfer_sum(decode), transfer_bytes(decode)
    d = first_token_s(decode.url, body, rid)
    transfer = transfer_sum(decode) - before
    moved = transfer_bytes(decode) - before_bytes
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)
    body = prompts.fresh()  # the legs above left this prompt in both caches
    t0 = time.perf_counter()
    with ThreadPoolExecutor(1) as pool:
        leg = pool.submit(prefill_leg_s, prefill, body, rid)
        first_token_s(decode.url, body, rid)
        concurrent = time.perf_counter() - t0
        leg.result()
    values = (colocated, p, transfer, d - transfer, p + d, concurrent)
    ms = {key: value * 1000 for key, value in zip(PARTS, values)}
    # ratios within the round: its paths ran seconds apart, so the box's load swings (+-50 ms on
    # a prefill here) mostly cancel, where a ratio of medians would not
    return {**ms, "pf_ratio": (p + d) / colocated, "concurrent_ratio": concurrent / colocated,
            "kv_mb": moved / 1e6, "transfer_gbps": moved / transfer / 1e9 if transfer > 0 else 0.0,
            "prompt_tokens": usage.get("prompt_tokens", 0)}


def medians(samples: list[dict[str, float]]) -> dict[str, float]:
    return {k: statistics.median(s[k] for s in samples) for k in PARTS}


def measure(both: Proc, prefill: Proc, decode: Proc, prompts: Prompts, repeats: int) -> dict[str, float]:
    """Median ms of each part in ``PARTS`` over ``repeats`` rounds (after a warm-up round)."""
    sample(both, prefill, decode, prompts)  # warms up every process
    return medians([sample(both, prefill, decode, prompts) for _ in range(repeats)])


def memory_mb(proc: Proc) -> dict[str, float]:
    """The process's resident memory now (VmRSS) and at its peak (VmHWM), MB (10^6 bytes)."""
    fields = {}
    for line in Path(f"/proc/{proc.popen.pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = int(value.split()[0]) * 1024 / 1e6  # kB
    return fields


def itl_sample(prefill: Proc, decode: Proc, prompt_tokens: int, stream_tokens: int,
               rng: random.Random) -> dict[str, float]:
    """Inter-token gaps (ms) of a request decoding on D, before and while another prompt's KV
    arrives on D. The second prompt is prefilled first (its KV waits on P), so the window holds
    D's intake, the transfer and the landing, not P's compute on a shared machine."""
    short = {"prompt": [rng.randrange(4, 2048) for _ in range(16)], "max_tokens": stream_tokens,
             "temperature": 0, "ignore_eos": True}
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)
    prefill_leg_s(prefill, short, rid)
    body = {"prompt": [rng.randrange(4, 2048) for _ in range(prompt_tokens)], "max_tokens": 2,
            "temperature": 0, "ignore_eos": True}
    rid2 = make_request_id(prefill.kv_addr, decode.kv_addr)
    prefill_leg_s(prefill, body, rid2)  # KV held on P until D asks
    times: list[float] = []
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(token_times, decode.url, short, rid, times)
        deadline = time.monotonic() + 120
        while len(times) < 32 and not running.done() and time.monotonic() < deadline:  # steady decoding
            time.sleep(0.001)
        window_start = time.perf_counter()
        arrival = first_token_s(decode.url, body, rid2)
        window_end = window_start + arrival
        running.result()
    gaps = [(b - a, b) for a, b in zip(times, times[1:])]
    before = [g for g, t in gaps if t < window_start]
    # during: gaps that end in the window or within the longest earlier gap after it (the step it delayed)
    during = [g for g, t in gaps if window_start <= t <= window_end + max(before, default=0)]
    return {"itl_before": 1000 * statistics.median(before) if before else 0.0,
            "itl_during_max": 1000 * max(during, default=0.0),
            "itl_during_p50": 1000 * statistics.median(during) if during else 0.0,
            "arrival": 1000 * arrival}


def parity_bodies(n: int, rng: random.Random) -> list[dict]:
    """``n`` greedy requests, prompts of 16 to ~600 tokens (one block to many), all unseen."""
    return [{"prompt": [rng.randrange(4, 2048) for _ in range(16 + i * 97 % 600)], "max_tokens": 16,
             "temperature": 0, "ignore_eos": True} for i in range(n)]


def completion(url: str, body: dict, request_id: str | None = None) -> tuple[str, int]:
    """(text, completion_tokens) of one non-streaming request."""
    headers = {"X-Request-Id": request_id} if request_id else {}
    r = HTTP.post(url + "/v1/completions", json={**body, "stream": False}, headers=headers)
    r.raise_for_status()
    data = r.json()
    return data["choices"][0]["text"], data["usage"]["completion_tokens"]


def pair_completion(prefill: Proc, decode: Proc, body: dict) -> tuple[str, int]:
    """``body`` through the pair the way the proxy sends it: both legs at once."""
    rid = make_request_id(prefill.kv_addr, decode.kv_addr)
    with ThreadPoolExecutor(1) as pool:
        leg = pool.submit(prefill_leg_s, prefill, body, rid)
        answer = completion(decode.url, body, rid)
        leg.result()
    return answer


def compare(expected: list[tuple[str, int]], got: list[tuple[str, int]]) -> dict:
    """How many answers are identical (text and token count), and the first that is not."""
    mismatches = [i for i, (a, b) in enumerate(zip(expected, got)) if a != b]
    first = None
    if mismatches:
        i = mismatches[0]
        first = {"index": i, "expected": expected[i][0][:200], "got": got[i][0][:200]}
    return {"n": len(expected), "identical": len(expected) - len(mismatches), "first_mismatch": first}


def up_parity(model: str | None, bodies: list[dict], expected: list[tuple[str, int]], up_env: dict[str, str],
              run_dir: Path) -> dict:
    """``bodies`` through a fresh `pdserve up` (its proxy), compared with ``expected``; then `down`."""
    ports = {name: free_port() for name in PORT_FLAGS}
    cli = [sys.executable, "-m", "pdserve.cli"]
    up = [*cli, "up", "--run-dir", str(run_dir), "--timeout", "300",
          *[f"--{name.replace('_', '-')}={port}" for name, port in ports.items()],
          *(["--model", model] if model else [])]
    pythonpath = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, **up_env, "PYTHONPATH": pythonpath}
    try:
        started = subprocess.run(up, cwd=ROOT, env=env, capture_output=True, text=True)
        if started.returncode != 0:
            return {"error": f"pdserve up exited {started.returncode}: {started.stderr.strip()[-2000:]}"}
        proxy = f"http://127.0.0.1:{ports['proxy_port']}"
        got = [completion(proxy, body) for body in bodies]
        transport = pair_transport(f"http://127.0.0.1:{ports['decode_port']}")
    finally:
        subprocess.run([*cli, "down", "--run-dir", str(run_dir)], cwd=ROOT, env=env, capture_output=True)
    return {**compare(expected, got), "transport": transport}


@contextlib.contextmanager
def visible_gpu(index: int | None):
    """Processes started inside see only GPU ``index`` (``start`` copies os.environ when it starts one)."""
    if index is None:
        yield
        return
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    try:
        yield
    finally:
        if before is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before


def colocated_args(node_args: list[str]) -> list[str]:
    """``node_args`` without the P/D pair's flags, which ``pdserve serve`` refuses (``--kv-transport``)."""
    out, skip = [], False
    for arg in node_args:
        if skip:
            skip = False
        elif arg == "--kv-transport":
            skip = True
        elif not arg.startswith("--kv-transport="):
            out.append(arg)
    return out


def run(args, node_args: list[str], model: str | None, label: str, tokenizer=None) -> dict:
    """Every measurement ``args`` asks for, printed, and returned as one dict."""
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-ttft-"))
    procs = []
    report: dict = {"prompt_tokens": args.prompt_tokens, "repeats": args.repeats, "model": label, "chat": args.chat}
    try:
        procs = [start("both", tmp, *colocated_args(node_args)), start("prefill", tmp, *node_args)]
        with visible_gpu(args.decode_gpu):
            procs.append(start("decode", tmp, *node_args))
        prose = english_tokens(tokenizer) if args.chat else None
        prompts = Prompts(args.prompt_tokens, random.Random(0), prose, tokenizer)
        report["median"] = measure(*procs, prompts, args.repeats)
        report["memory_mb"] = {proc.name: memory_mb(proc) for proc in procs}
        if args.itl:
            rng = random.Random(1)
            runs = [itl_sample(procs[1], procs[2], args.prompt_tokens, 300, rng) for _ in range(args.repeats)]
            report["itl"] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        report["transport"] = pair_transport(procs[2].url)
        bodies = parity_bodies(max(args.parity, args.up_parity), random.Random(2))
        expected = [completion(procs[0].url, body) for body in bodies]
        if args.parity:
            got = [pair_completion(procs[1], procs[2], body) for body in bodies[:args.parity]]
            report["parity_pair"] = {**compare(expected[:args.parity], got), "transport": report["transport"]}
    finally:
        for proc in procs:
            proc.stop()
    if args.up_parity:  # after the three have stopped: `up`'s daemons take their own GPU shares
        report["parity_up"] = up_parity(model, bodies[:args.up_parity], expected[:args.up_parity],
                                        dict(kv.split("=", 1) for kv in args.up_env),
                                        Path(args.up_run_dir) if args.up_run_dir else tmp / "up")
    print_report(report)
    return report


def print_report(report: dict) -> None:
    med, n = report["median"], report["repeats"]
    kind = "chat prompt" if report.get("chat") else "prompt"
    print(f"\nTTFT for a {med['prompt_tokens']:.0f}-token {kind} ({report['model']}; KV over {report['transport']}; "
          f"KV {med['kv_mb']:.1f} MB; median of {n})\n")
    print("| path | part | ms |")
    print("|---|---|---:|")
    print(f"| colocated | prefill + first token | {med['colocated']:.1f} |")
    print(f"| disaggregated, prefill first | prefill compute (prefill leg) | {med['prefill']:.1f} |")
    print(f"| | KV transfer (PULL to DONE) | {med['transfer']:.1f} |")
    print(f"| | handoff (decode leg minus transfer) | {med['handoff']:.1f} |")
    print(f"| | total | {med['pf_total']:.1f} |")
    print(f"| disaggregated, concurrent legs | total | {med['concurrent']:.1f} |")
    print(f"\noverhead vs colocated: prefill-first {med['pf_total'] - med['colocated']:+.1f} ms, "
          f"concurrent {med['concurrent'] - med['colocated']:+.1f} ms (difference of medians); "
          f"TTFT / colocated TTFT, median of per-round ratios: prefill-first {med['pf_ratio']:.3f}, "
          f"concurrent {med['concurrent_ratio']:.3f}")
    print(f"KV transfer bandwidth (bytes / PULL-to-DONE time, prefill-first legs): {med['transfer_gbps']:.2f} GB/s")
    memory = report.get("memory_mb", {})
    if memory:
        print("resident memory after the rounds, MB now (peak): " + ", ".join(
            f"{name} {m['VmRSS']:,.0f} ({m['VmHWM']:,.0f})" for name, m in memory.items()))
    itl = report.get("itl")
    if itl is not None:
        print(f"\nITL of a request decoding on D while a {report['prompt_tokens']}-token prompt's KV arrives "
              f"(median of {n}): before {itl['itl_before']:.2f} ms, during p50 {itl['itl_during_p50']:.2f} ms, "
              f"during max {itl['itl_during_max']:.2f} ms (arrival: {itl['arrival']:.1f} ms)")
    for key, path in (("parity_pair", "the prefill -> decode pair"), ("parity_up", "`pdserve up`'s proxy")):
        result = report.get(key)
        if result is None:
            continue
        if "error" in result:
            print(f"parity through {path}: {result['error']}")
            continue
        print(f"parity through {path} (KV over {result['transport']}): {result['identical']}/{result['n']} greedy "
              f"answers identical to the colocated node's" + (f"; first mismatch: {result['first_mismatch']}"
                                                                if result["first_mismatch"] else ""))


def parity_ok(report: dict) -> bool:
    results = [report[k] for k in ("parity_pair", "parity_up") if k in report]
    return all("error" not in r and r["identical"] == r["n"] for r in results)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default=EMBEDDED_MODEL_SPEC,
                        help="what every node serves: embedded (the tiny random model, default), default "
                             "(SmolLM2-135M-Instruct), a Hugging Face directory or a .gguf")
    parser.add_argument("--chat", action="store_true",
                        help="a chat prompt of English text (/v1/chat/completions) instead of random token ids")
    parser.add_argument("--shape", default=None,
                        help="serve a random-weight checkpoint of this bench/gpu_engine.py shape, made on the GPU")
    parser.add_argument("--workdir", default=None, help="where --shape's checkpoint is (made if missing)")
    parser.add_argument("--node-arg", action="append", default=[],
                        help="appended to every node's command line, e.g. --node-arg=--gpu-memory-utilization=0.28")
    parser.add_argument("--decode-gpu", type=int, default=None, help="the decode daemon sees only this GPU")
    parser.add_argument("--itl", action="store_true",
                        help="also measure a running request's inter-token gaps while another prompt's KV arrives")
    parser.add_argument("--parity", type=int, default=0, metavar="N",
                        help="N greedy requests through the pair, compared with the colocated node")
    parser.add_argument("--up-parity", type=int, default=0, metavar="N",
                        help="N greedy requests through `pdserve up`'s proxy, compared with the colocated node")
    parser.add_argument("--up-env", action="append", default=[], metavar="KEY=VALUE",
                        help="environment for `pdserve up`'s processes, e.g. PDSERVE_KV_TRANSPORT=cuda_ipc")
    parser.add_argument("--up-run-dir", default=None, metavar="DIR",
                        help="`pdserve up`'s run directory (default: a temporary one); `pdserve down --run-dir "
                             "DIR` stops what a killed run left")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every figure here")
    args = parser.parse_args()
    model, name, tokenizer = None, None, None
    if args.shape:
        import torch
        from gpu_engine import make_checkpoint

        if not torch.cuda.is_available():
            print("--shape makes its checkpoint on a GPU; CUDA is not available here")
            return 0
        workdir = Path(args.workdir or tempfile.mkdtemp(prefix="pdserve-shape-"))
        workdir.mkdir(parents=True, exist_ok=True)
        model = str(make_checkpoint(args.shape, workdir))
    else:
        from common.model.sources import resolve_model

        model_dir, name = resolve_model(None if args.model == "default" else args.model, DEFAULT_CACHE_DIR)
        model = str(model_dir)
    if args.chat:
        from common.model.tokenizer import Tokenizer

        tokenizer = Tokenizer.from_dir(model)
    node_args = ["--model", model, *(["--served-model-name", name] if name else []), *args.node_arg]
    label = f"{args.shape or name}, {' '.join(args.node_arg) or 'default flags'}"
    report = run(args, node_args, model, label, tokenizer)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0 if parity_ok(report) else 1


if __name__ == "__main__":
    sys.exit(main())
