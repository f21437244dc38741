"""The whole GPU acceptance in one command (issue 18): one table, one JSON file.

    python bench/gpu_check.py OUT [--workdir DIR]          (make gpu-check [OUT=DIR] [PYTHON=...])

It needs this checkout and a Python with torch (CUDA), triton and pdserve's dependencies; it
installs nothing and reaches no network. Every step gets the repository root on PYTHONPATH,
in front of whatever PYTHONPATH already holds (e.g. a directory of wheels installed with
``pip install --target``: the README's "GPU acceptance" says which and how).

Steps, each a subprocess in its own process group with its own timeout. One that overruns is
interrupted (SIGINT, so its ``finally`` blocks stop the servers it started), then killed with
everything it started, and marked FAIL "timed out":

| step | timeout | what |
|---|---:|---|
| pytest | 175 s | ``pytest -m gpu`` over the test files that hold gpu-marked tests (with |
| | | ``--batch-invariant``'s: test_batch_invariant_engine.py, logits bitwise in any batch) |
| checkpoints | 50 s | random bf16 checkpoints of a Qwen2.5-0.5B and a Llama-3.1-8B shape |
| engine | 75 s | decode ms/step at batch 1 and 64, CUDA graphs and eager, beside the memory floor; |
| | | the KV host tier's copy bandwidth against a pinned ``copy_`` (bench/kv_tier_copy.py, >= 0.7x) |
| ttft | 100 s | TTFT of a 2,000-token prompt on the 8B shape; ``--batch-invariant``'s cost |
| cuda_ipc | 95 s | one GPU, 8B: `pdserve up`'s proxy vs a colocated node on 20 greedy requests; |
| | | TTFT disaggregated / colocated and the KV bandwidth of a 2,000-token move (ttft_breakdown) |
| kv_tiers | 120 s | one GPU, 0.5B: bench/kv_tiers.py's multi-turn trace (2,000-token contexts, host tier |
| | | on the prefill node, pools ~5x smaller than the working set): TTFT of turns >= 2 off / on |
| | | (>= 4x), ITL p50 (<= +5 %), answers identical (issue 35) |
| nccl | 45 s | the same over an NCCL pair, prefill on GPU 0, decode on GPU 1 (parity through the pair) |

The run has a budget (``--budget-s``, 570 s with the probe): a step runs only if its timeout, its 3 s
of grace and its clean-up (`pdserve down`, 20 s) fit in what is left, else it is SKIP with the
reason, so a run ends within one 10-minute device call even if every step hangs. An H200 took
95-158 s for pytest (Triton compiling on a fresh machine), 35-49 s for the checkpoints, 38-51 s
for the engine, 11-31 s for ttft and 58-66 s for cuda_ipc (2026-11-27); the kv_tiers step has not
run on a GPU yet. ``--timeout-scale`` scales the timeouts, ``--steps`` picks some. Writes OUT/gpu-check.md (printed last) and
OUT/gpu-check.json; each step's output is in OUT/logs/. Without CUDA every step is SKIP
("no CUDA device") and the exit code is 0; it is 1 when a step FAILs.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from gpu_check_runner import (FAIL, PASS, ROOT, Context, Figure, Step, StepResult, Verdict, exit_code,
                              last_line, render_table, run_step, skip_reason, step_env)

PROBE_TIMEOUT_S = 15.0
BUDGET_S = 570.0  # the whole run, probe included: within a lent machine's 10 minutes a command
# what the steps import; a GPU machine without network may lack the pure-Python ones
MODULES = ("torch", "triton", "transformers", "safetensors", "tokenizers", "jinja2", "httpx", "msgpack",
           "prometheus_client", "zmq", "fastapi", "starlette", "uvicorn", "pydantic", "pytest")
SHAPES = {"qwen2.5-0.5b": "0.5B", "llama3.1-8b": "8B"}
TTFT_RATIO_GOAL = 1.05
KV_GBPS_GOAL = 500.0
PARITY_REQUESTS = 20


# ---------------------------------------------------------------------------- the steps

def gpu_test_files() -> list[str]:
    """Test files holding gpu-marked tests: pytest then imports only these (the rest of the
    suite needs packages a GPU machine may not have)."""
    tests = sorted((ROOT / "tests").rglob("test_*.py"))
    return [str(p.relative_to(ROOT)) for p in tests if "pytest.mark.gpu" in p.read_text(errors="replace")]


def judge_pytest(ctx: Context, code: int, text: str) -> Verdict:
    summary = next((line for line in reversed(text.splitlines()) if re.search(r"\d+ (passed|failed|skipped|error)",
                                                                             line)), "")
    counts = {word: int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary)}
    passed, skipped = counts.get("passed", 0), counts.get("skipped", 0)
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    figure = Figure("gpu tests", f"{passed} passed, {failed} failed, {skipped} skipped", "0 failed", failed == 0)
    if code == 0 and passed:
        return PASS, f"{passed} passed ({skipped} skipped: reasons in the log)", [figure]
    if code == 0:
        return FAIL, "every gpu test skipped on a CUDA machine (reasons in the log)", [figure]
    return FAIL, f"pytest exited {code}: {summary.strip(' =') or last_line(text)}", [figure]


def judge_checkpoints(ctx: Context, code: int, text: str) -> Verdict:
    if code != 0:
        return FAIL, f"exit {code}: {last_line(text)}", []
    made = ctx.results("checkpoints")["checkpoints"]
    figures = [Figure(SHAPES.get(c["shape"], c["shape"]), f"{c['bytes'] / 1e9:.2f} GB in {c['seconds']:.0f} s")
               for c in made]
    return PASS, "written", figures


def judge_engine(ctx: Context, code: int, text: str) -> Verdict:
    results = ctx.results("engine")
    rows = results["decode"]
    eager = {(r["shape"], r["batch"]): r["ms_per_step"] for r in rows if not r["graphs"]}
    figures, missed = [], []
    # the engine falls back to SDPA (no Triton) or to eager steps (a failed capture) with a warning only
    backends = sorted({e["backend"] for e in results["engines"]})
    captured = all(e["graph_sizes"] for e in results["engines"] if e["graphs"])
    for label, value, goal, met in (("attention", ", ".join(backends), "triton", backends == ["triton"]),
                                    ("CUDA graphs", "captured" if captured else "NOT captured", "captured",
                                     captured)):
        figures.append(Figure(label, value, goal, met))
        if not met:
            missed.append(f"{label} {value}")
    for r in (r for r in rows if r["graphs"]):
        label = f"{SHAPES.get(r['shape'], r['shape'])} batch {r['batch']}"
        ms, goal = r["ms_per_step"], r["goal_ms"]
        met = None if goal is None else ms <= goal
        value = f"{ms:.2f} ms/step (eager {eager.get((r['shape'], r['batch']), float('nan')):.2f}, " \
                f"floor {r['floor_ms']:.2f})"
        figures.append(Figure(label, value, "" if goal is None else f"<= {goal:g} ms", met))
        if met is False:
            missed.append(f"{label} {ms:.2f} > {goal:g} ms")
    tier = results.get("tier_copy")
    if tier is not None:  # issue 35: the KV host tier's copies, both ways, against a pinned copy_
        for way in ("down", "up"):
            ratio, label = tier[f"ratio_{way}"], f"KV host tier {'pool -> host' if way == 'down' else 'host -> pool'}"
            figures.append(Figure(label, f"{tier[f'tier_{way}']:.1f} GB/s, {ratio:.2f}x a pinned copy_",
                                  f">= {tier['goal']:.2f}x", ratio >= tier["goal"]))
            if ratio < tier["goal"]:
                missed.append(f"{label} {ratio:.2f}x")
    if code != 0:
        return FAIL, f"exit {code}: {last_line(text)}", figures
    return (FAIL, "goal not met: " + "; ".join(missed), figures) if missed else (PASS, "every goal met", figures)


TIERS_TTFT_GOAL, TIERS_ITL_GOAL = 4.0, 0.05  # issue 35: >= 4x better TTFT at >= 2,000 tokens; ITL <= +5 %


def judge_kv_tiers(ctx: Context, code: int, text: str) -> Verdict:
    """bench/kv_tiers.py on the 0.5B shape: turns >= 2's TTFT with the host tier against without,
    the ITL beside it, and the answers (identical with the tier on and off)."""
    if code != 0:
        return FAIL, f"exit {code}: {last_line(text)}", []
    r = ctx.results("kv_tiers")
    figures = [Figure("KV tiers: TTFT p50 of turns >= 2, off / on", f"{r['ttft_ratio']:.2f}x "
                      f"({r['system_tokens']:,}-token contexts, host-tier hit rate {r['tier_hit_rate']:.0%})",
                      f">= {TIERS_TTFT_GOAL:g}x", r["ttft_ratio"] >= TIERS_TTFT_GOAL),
               Figure("KV tiers: ITL p50 change", f"{r['itl_p50_change']:+.1%} (p99 {r['itl_p99_change']:+.1%})",
                      f"<= +{TIERS_ITL_GOAL:.0%}", r["itl_p50_change"] <= TIERS_ITL_GOAL),
               Figure("KV tiers: answers identical, tier on / off", f"{r['identical']}/{r['answers']}",
                      "all", r["identical"] == r["answers"])]
    missed = [f.label for f in figures if f.met is False]
    return (FAIL, "goal not met: " + "; ".join(missed), figures) if missed else (PASS, "every goal met", figures)


def judge_ttft(ctx: Context, code: int, text: str) -> Verdict:
    """The 8B shape's TTFT (the default engine), and ``--batch-invariant``'s cost beside the
    default (issue 34: output tokens/s of decode steps, and TTFT; no goal on a GPU)."""
    results = ctx.results("ttft")
    info = next(e for e in results["engines"] if e["ttft_goal_ms"] is not None and not e.get("invariant"))
    ms, goal = info["ttft_ms"], info["ttft_goal_ms"]
    figure = Figure(f"8B, {info['ttft_tokens']}-token prompt", f"{ms:.1f} ms", f"<= {goal:g} ms", ms <= goal)
    figures = [figure]
    for e in (e for e in results["engines"] if e.get("invariant")):
        figures.append(Figure(f"--batch-invariant {SHAPES.get(e['shape'], e['shape'])}: kernels",
                              f"attention {e['backend']}, linears {e['linears']}, CUDA graphs "
                              f"{'captured' if e['graph_sizes'] else 'NOT captured'}"))
    for c in results.get("invariant_cost", []):
        figures.append(Figure(f"--batch-invariant {SHAPES.get(c['shape'], c['shape'])}, {c['what']}",
                              f"{c['invariant']:.1f} {c['unit']} against {c['default']:.1f}: cost {c['cost']:.0%}"))
    if code != 0:
        return FAIL, f"exit {code}: {last_line(text)}", figures
    return (PASS, "goal met", figures) if figure.met else (FAIL, f"TTFT {ms:.1f} > {goal:g} ms", figures)


def judge_disaggregated(transport: str, parity_key: str, parity_label: str) -> Callable[[Context, int, str], Verdict]:
    """ttft_breakdown's report: greedy parity, the data plane used, TTFT ratio, KV bandwidth."""
    def judge(ctx: Context, code: int, text: str) -> Verdict:
        report = ctx.results(transport)
        med, parity = report["median"], report[parity_key]
        want = f"{PARITY_REQUESTS}/{PARITY_REQUESTS} identical"
        if "error" in parity:
            figures = [Figure(parity_label, parity["error"][:300], want, False)]
        else:
            figures = [Figure(parity_label, f"{parity['identical']}/{parity['n']} identical", want,
                              parity["identical"] == parity["n"] == PARITY_REQUESTS)]
            if parity_key == "parity_up":  # `up`'s own pair, besides the bench's
                figures.append(Figure("pdserve up's KV over", parity["transport"], transport,
                                      parity["transport"] == transport))
        figures += [
            Figure("KV over", report["transport"], transport, report["transport"] == transport),
            Figure("TTFT disaggregated / colocated", f"{med['concurrent_ratio']:.3f}x (prefill-first "
                   f"{med['pf_ratio']:.3f}x)", f"<= {TTFT_RATIO_GOAL}x", med["concurrent_ratio"] <= TTFT_RATIO_GOAL),
            Figure(f"KV move of {med['kv_mb']:.0f} MB", f"{med['transfer_gbps']:.0f} GB/s",
                   f">= {KV_GBPS_GOAL:g} GB/s", med["transfer_gbps"] >= KV_GBPS_GOAL),
        ]
        missed = [f.label for f in figures if f.met is False]
        if missed:
            return FAIL, "goal not met: " + "; ".join(missed), figures
        if code != 0:
            return FAIL, f"exit {code}: {last_line(text)}", figures
        return PASS, "every goal met", figures
    return judge


def bench(script: str, *args: str) -> Callable[[Context], list[str]]:
    """A step command: ``bench/<script> args``, with ``{ckpt}`` and ``{work}`` filled in."""
    def command(ctx: Context) -> list[str]:
        return [ctx.python, str(ROOT / "bench" / script),
                *(a.format(ckpt=ctx.checkpoints, work=ctx.work) for a in args)]
    return command


def disaggregated_args(transport: str, share: str, *extra: str) -> tuple[str, ...]:
    return ("--shape", "llama3.1-8b", "--workdir", "{ckpt}", "--prompt-tokens", "2000", "--repeats", "3",
            "--node-arg=--device=cuda", f"--node-arg=--gpu-memory-utilization={share}",
            f"--node-arg=--kv-transport={transport}", "--json", f"{{work}}/{transport}.json", *extra)


STEPS = [
    Step("pytest", "pytest -m gpu", 175,
         lambda ctx: [ctx.python, "-m", "pytest", "-q", "-rs", "-m", "gpu", "-p", "no:cacheprovider",
                      *gpu_test_files()], judge_pytest),
    Step("checkpoints", "random checkpoints (0.5B, 8B shapes)", 50,
         bench("gpu_engine.py", "--make-checkpoints", "--workdir", "{ckpt}", "--json", "{work}/checkpoints.json"),
         judge_checkpoints),
    Step("engine", "decode ms/step, graphs and eager", 75,
         bench("gpu_engine.py", "--shapes", "qwen2.5-0.5b,llama3.1-8b", "--batches", "1,64", "--eager",
               "--no-transformers", "--ttft-tokens", "0", "--tier-copy", "--workdir", "{ckpt}", "--json",
               "{work}/engine.json"),
         judge_engine, needs="checkpoints"),
    Step("ttft", "TTFT, 2,000 tokens, 8B; --batch-invariant's cost", 100,
         bench("gpu_engine.py", "--shapes", "qwen2.5-0.5b,llama3.1-8b", "--batches", "1,16", "--batch-invariant",
               "both", "--ttft-tokens", "2000", "--no-transformers", "--workdir", "{ckpt}", "--json",
               "{work}/ttft.json"),
         judge_ttft, needs="checkpoints"),
    Step("cuda_ipc", "pdserve up on one GPU (cuda_ipc)", 95,
         # every request disaggregated: the proxy may otherwise prefill a short prompt on the decode node
         bench("ttft_breakdown.py", *disaggregated_args("cuda_ipc", "0.28", "--up-parity", str(PARITY_REQUESTS),
                                                         "--up-env", "PDSERVE_KV_TRANSPORT=cuda_ipc",
                                                         "--up-env", "PDSERVE_DISAGG_POLICY=always",
                                                         "--up-run-dir", "{work}/up")),
         judge_disaggregated("cuda_ipc", "parity_up", "pdserve up, proxy vs colocated"), needs="checkpoints",
         # `up`'s daemons leave the step's process tree (the launcher exits once they are ready)
         cleanup=lambda ctx: [ctx.python, "-m", "pdserve.cli", "down", "--run-dir", str(ctx.work / "up")]),
    Step("kv_tiers", "KV tiers trace, 0.5B, one GPU (host tier)", 120,
         # issue 35: turns >= 2 of a multi-turn trace whose working set is ~5x the pools, host tier off / on
         bench("kv_tiers.py", "--model", "{ckpt}/qwen2.5-0.5b", "--token-ids", "--tier", "host",
               "--system-tokens", "2000", "--conversations", "8", "--turns", "3", "--pool-blocks", "192",
               "--node-arg=--device=cuda", "--node-arg=--gpu-memory-utilization=0.2",
               "--node-arg=--kv-transport=cuda_ipc", "--json", "{work}/kv_tiers.json"),
         judge_kv_tiers, needs="checkpoints"),
    Step("nccl", "NCCL pair, cuda:0 -> cuda:1", 45,
         bench("ttft_breakdown.py", *disaggregated_args("nccl", "0.45", "--decode-gpu", "1",
                                                         "--parity", str(PARITY_REQUESTS))),
         judge_disaggregated("nccl", "parity_pair", "P->D pair vs colocated"), gpus=2,
         fewer_gpus="one GPU: NCCL refuses two ranks on one GPU", needs="checkpoints"),
]


# ---------------------------------------------------------------------------- the run

PROBE = f"""
import importlib.util, json
info = {{"missing": [m for m in {MODULES!r} if importlib.util.find_spec(m) is None]}}
import torch
gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
info.update(torch=torch.__version__, cuda=torch.version.cuda, gpus=gpus,
            names=[torch.cuda.get_device_name(i) for i in range(gpus)])
print(json.dumps(info))
"""


def probe(python: str) -> dict:
    """The machine as the steps will see it: torch, its GPUs, the modules missing."""
    try:
        proc = subprocess.run([python, "-c", PROBE], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                              cwd=ROOT, env=step_env())
    except subprocess.TimeoutExpired:
        return {"error": f"the probe (import torch, count GPUs) took over {PROBE_TIMEOUT_S:g} s"}
    if proc.returncode != 0:
        return {"error": last_line(proc.stderr)}
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return {"error": f"the probe printed no JSON: {last_line(proc.stdout)}"}


def describe(machine: dict) -> str:
    if "error" in machine:
        return f"probe failed: {machine['error']}"
    gpus = ", ".join(machine["names"]) or "no CUDA device"
    missing = f"; missing modules: {', '.join(machine['missing'])}" if machine["missing"] else ""
    build = f"CUDA {machine['cuda']}" if machine["cuda"] else "a CPU build"
    return f"{gpus}; torch {machine['torch']} ({build}){missing}"


def run_all(steps: list[Step], ctx: Context) -> list[StepResult]:
    done: dict[str, StepResult] = {}
    for i, step in enumerate(steps, 1):
        if skip_reason(step, ctx, done) is None:
            print(f"[{i}/{len(steps)}] {step.title} (timeout {step.timeout_s:g} s) ...", flush=True)
        result = done[step.name] = run_step(step, ctx, done)
        print(f"[{i}/{len(steps)}] {step.title}: {result.status} ({result.wall_s:.0f} s) {result.reason}",
              flush=True)
    return list(done.values())


def write_report(out: Path, machine: dict, results: list[StepResult], wall_s: float) -> str:
    """OUT/gpu-check.md and OUT/gpu-check.json; returns the markdown."""
    code = exit_code(results)
    verdict = "FAIL: " + ", ".join(r.name for r in results if r.status == FAIL) if code else "no step failed"
    markdown = (f"# GPU acceptance (make gpu-check)\n\n{describe(machine)}; "
                f"{time.strftime('%Y-%m-%d %H:%M %Z')}; {wall_s:.0f} s; {verdict}\n\n{render_table(results)}\n")
    (out / "gpu-check.md").write_text(markdown)
    report = {"machine": machine, "wall_s": wall_s, "exit_code": code, "steps": [asdict(r) for r in results]}
    (out / "gpu-check.json").write_text(json.dumps(report, indent=1))
    return markdown


def main(argv: list[str] | None = None, steps: list[Step] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", nargs="?", default="gpu-check-out", help="where the table, the JSON and logs/ go")
    ap.add_argument("--workdir", default=None,
                    help="where checkpoints (~17 GB) go and stay (default: a temporary directory, removed)")
    ap.add_argument("--steps", default=None, help="only these steps, comma-separated (with those they need)")
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help="the whole run's time: a step whose timeout (with its grace and clean-up) no longer fits "
                         "in what is left is SKIP, so a run ends within one 10-minute device call")
    ap.add_argument("--timeout-scale", type=float, default=1.0,
                    help="multiply every step's timeout (the timeouts are estimates; a first run on a new "
                         "machine may want more room)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    try:
        machine = probe(sys.executable)
        ctx = Context(python=sys.executable, out=out.resolve(), work=work.resolve(), gpus=machine.get("gpus", 0),
                      missing=machine.get("missing", []), probe_error=machine.get("error"),
                      deadline=t0 + args.budget_s)
        chosen = STEPS if steps is None else steps
        if args.steps:
            wanted = set(args.steps.split(","))
            wanted |= {s.needs for s in chosen if s.name in wanted and s.needs}
            chosen = [s for s in chosen if s.name in wanted]
        results = run_all([replace(s, timeout_s=s.timeout_s * args.timeout_scale) for s in chosen], ctx)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    print("\n" + write_report(out, machine, results, time.monotonic() - t0), end="")
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
