"""bench/gpu_check.py: the GPU acceptance harness, on CPU.

Without CUDA it must still run (CI does), mark every step SKIP with the reason and write both
files. Its parts are checked with fake steps: a table of figures beside their goals, a step
past its timeout (FAIL, nothing it started left alive), a failed step's dependants skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import gpu_check  # noqa: E402
from gpu_check_runner import FAIL, PASS, SKIP, Context, Figure, Step, StepResult, render_table, run_step  # noqa: E402


def test_without_cuda_every_step_is_skipped_and_both_files_are_written(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # hides a GPU where there is one
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_check.py"), str(out)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((out / "gpu-check.json").read_text())
    steps = report["steps"]
    assert [s["name"] for s in steps] == ["pytest", "checkpoints", "engine", "ttft", "cuda_ipc", "kv_tiers", "nccl"]
    assert all(s["status"] == SKIP and s["reason"] == "no CUDA device" for s in steps), steps
    assert report["exit_code"] == 0
    table = (out / "gpu-check.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and "SKIP" in line]
    assert len(rows) == len(steps)
    for step, row in zip(steps, rows):
        assert step["title"] in row and "no CUDA device" in row
    assert proc.stdout.rstrip().endswith(rows[-1])  # the table is printed last


def test_table_shows_each_figure_beside_its_goal() -> None:
    results = [
        StepResult("engine", "decode ms/step", PASS, "every goal met",
                   [Figure("8B batch 1", "7.10 ms/step", "<= 8 ms", True), Figure("eager", "20.00 ms/step")],
                   timeout_s=110, wall_s=61.4),
        StepResult("ttft", "TTFT", FAIL, "TTFT 80.0 > 70 ms | slow", [Figure("8B", "80.0 ms", "<= 70 ms", False)],
                   timeout_s=35, wall_s=20.0),
        StepResult("nccl", "NCCL pair", SKIP, "one GPU: NCCL refuses two ranks on one GPU", timeout_s=45),
    ]
    engine, ttft, nccl = render_table(results).splitlines()[2:]
    assert "| PASS |" in engine and "8B batch 1: 7.10 ms/step (goal <= 8 ms: met); eager: 20.00 ms/step" in engine
    assert "| 61 / 110 |" in engine
    assert "| FAIL |" in ttft and "8B: 80.0 ms (goal <= 70 ms: NOT met)" in ttft
    assert "80.0 > 70 ms \\| slow" in ttft  # a "|" in a reason does not split the row
    assert "| SKIP | - | one GPU: NCCL refuses two ranks on one GPU | - / 45 |" in nccl


def test_engine_figures_hold_each_decode_step_to_its_goal(tmp_path: Path) -> None:
    def row(shape: str, batch: int, graphs: bool, ms: float, goal: float | None) -> dict:
        return dict(shape=shape, batch=batch, graphs=graphs, ms_per_step=ms, floor_ms=5.3, goal_ms=goal)

    rows = [row("llama3.1-8b", 1, True, 7.5, 8.0), row("llama3.1-8b", 1, False, 19.0, 8.0),
            row("llama3.1-8b", 64, True, 12.5, 12.0)]
    engines = [dict(backend="triton", graphs=True, graph_sizes=[1, 2, 4]),
               dict(backend="triton", graphs=False, graph_sizes=None)]
    (tmp_path / "engine.json").write_text(json.dumps({"decode": rows, "engines": engines}))
    ctx = Context(python=sys.executable, out=tmp_path, work=tmp_path, gpus=1)
    status, reason, figures = gpu_check.judge_engine(ctx, 0, "")
    assert status == FAIL and reason == "goal not met: 8B batch 64 12.50 > 12 ms"
    assert [f.text() for f in figures] == [
        "attention: triton (goal triton: met)",
        "CUDA graphs: captured (goal captured: met)",
        "8B batch 1: 7.50 ms/step (eager 19.00, floor 5.30) (goal <= 8 ms: met)",
        "8B batch 64: 12.50 ms/step (eager nan, floor 5.30) (goal <= 12 ms: NOT met)",
    ]
    engines[0].update(backend="sdpa", graph_sizes=None)  # the fallbacks a warning alone would hide
    (tmp_path / "engine.json").write_text(json.dumps({"decode": rows[:1], "engines": engines}))
    status, reason, _ = gpu_check.judge_engine(ctx, 0, "")
    assert status == FAIL and reason == "goal not met: attention sdpa, triton; CUDA graphs NOT captured"


def test_ttft_figures_show_the_batch_invariant_cost_beside_the_default(tmp_path: Path) -> None:
    """``--batch-invariant both`` (issue 34): output tokens/s of decode steps and TTFT, each mode."""
    import gpu_engine

    def row(batch: int, invariant: bool, ms: float) -> dict:
        return dict(shape="qwen2.5-0.5b", batch=batch, graphs=True, invariant=invariant, ms_per_step=ms)

    def engine(shape: str, invariant: bool, ttft: float) -> dict:
        return dict(shape=shape, graphs=True, invariant=invariant, ttft_ms=ttft, ttft_tokens=2000,
                    ttft_goal_ms=70.0 if shape == "llama3.1-8b" else None, backend="triton",
                    linears="triton" if invariant else "default", graph_sizes=[1, 2])

    results = {"decode": [row(1, False, 1.5), row(1, True, 2.0), row(16, False, 2.0), row(16, True, 4.0)],
               "engines": [engine("llama3.1-8b", False, 52.0), engine("llama3.1-8b", True, 65.0)]}
    results["invariant_cost"] = gpu_engine.invariant_cost(results)
    (tmp_path / "ttft.json").write_text(json.dumps(results))
    ctx = Context(python=sys.executable, out=tmp_path, work=tmp_path, gpus=1)
    status, reason, figures = gpu_check.judge_ttft(ctx, 0, "")
    assert (status, reason) == (PASS, "goal met")
    assert [f.text() for f in figures] == [
        "8B, 2000-token prompt: 52.0 ms (goal <= 70 ms: met)",
        "--batch-invariant 8B: kernels: attention triton, linears triton, CUDA graphs captured",
        "--batch-invariant 0.5B, decode, batch 1: 500.0 tok/s against 666.7: cost 25%",
        "--batch-invariant 0.5B, decode, batch 16: 4000.0 tok/s against 8000.0: cost 50%",
        "--batch-invariant 8B, TTFT, 2000 tokens: 65.0 ms against 52.0: cost 25%",
    ]


def gone(pid: int) -> bool:
    """No such process, or only its zombie (killed, not yet reaped by init)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc to find a step's processes")
def test_step_past_its_timeout_fails_and_nothing_it_started_survives(tmp_path: Path) -> None:
    pid_file = tmp_path / "server.pid"
    # the step starts a "server" in a session of its own (as the benches do), then hangs
    script = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '30'], start_new_session=True); "
              "open(sys.argv[1], 'w').write(str(p.pid)); time.sleep(30)")
    cleaned = tmp_path / "cleaned"
    step = Step("hang", "hangs", 2, lambda ctx: [sys.executable, "-c", script, str(pid_file)],
                lambda ctx, code, text: (PASS, "finished", []), gpus=0,
                cleanup=lambda ctx: [sys.executable, "-c", f"open({str(cleaned)!r}, 'w')"])
    ctx = Context(python=sys.executable, out=tmp_path, work=tmp_path)
    result = run_step(step, ctx, {})
    assert result.status == FAIL and result.reason.startswith("timed out after 2 s"), result
    assert (tmp_path / "logs" / "hang.log").is_file()
    assert cleaned.is_file()  # the clean-up runs after a step that timed out, too
    server = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while not gone(server) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(server)


def test_a_failed_step_skips_its_dependants_and_the_exit_code_is_1(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    def command(code: int):
        return lambda ctx: [sys.executable, "-c", f"import sys; print('step ran'); sys.exit({code})"]

    def judge(ctx, code, text):
        return (PASS, "ran", []) if code == 0 and "step ran" in text else (FAIL, f"exit {code}", [])

    steps = [Step("first", "first", 30, command(0), judge, gpus=0),
             Step("second", "second", 30, command(3), judge, gpus=0),
             Step("third", "third", 30, command(0), judge, gpus=0, needs="second"),
             Step("gpu", "gpu", 30, command(0), judge)]
    out = tmp_path / "out"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the probe (a subprocess) sees no GPU
    assert gpu_check.main([str(out)], steps) == 1
    report = json.loads((out / "gpu-check.json").read_text())
    assert [(s["status"], s["reason"]) for s in report["steps"]] == [
        (PASS, "ran"), (FAIL, "exit 3"), (SKIP, "not run: step second did not pass"), (SKIP, "no CUDA device")]


def test_worst_case_fits_in_one_10_minute_device_call() -> None:
    """A run ends within its budget even if every step hangs (a step runs only if its timeout, grace
    and clean-up fit in what is left), and the budget is within the 10 minutes a lent GPU machine
    gives one command; every step alone fits in it."""
    from gpu_check_runner import CLEANUP_TIMEOUT_S, GRACE_S

    assert gpu_check.BUDGET_S < 10 * 60 - 20  # the report's writing after the last step
    for s in gpu_check.STEPS:
        assert gpu_check.PROBE_TIMEOUT_S + s.timeout_s + GRACE_S + CLEANUP_TIMEOUT_S < gpu_check.BUDGET_S, s.name


def test_a_step_that_would_overrun_the_budget_is_skipped_and_the_rest_still_run(tmp_path: Path) -> None:
    def quick(ctx):
        return [sys.executable, "-c", "print('ran')"]

    def judge(ctx, code, text):
        return PASS, "ran", []

    steps = [Step("long", "long", 60, quick, judge, gpus=0), Step("short", "short", 5, quick, judge, gpus=0)]
    out = tmp_path / "out"
    assert gpu_check.main([str(out), "--budget-s", "30"], steps) == 0
    report = json.loads((out / "gpu-check.json").read_text())
    (long, short) = report["steps"]
    assert long["status"] == SKIP and long["reason"].startswith("not run: it may take 63 s and "), long
    assert (short["status"], short["reason"]) == (PASS, "ran")


def test_kv_tiers_figures_hold_ttft_itl_and_answers_to_their_goals(tmp_path: Path) -> None:
    figures = {"ttft_ratio": 5.2, "itl_p50_change": 0.031, "itl_p99_change": 0.12, "identical": 24, "answers": 24,
               "tier": "host", "system_tokens": 2000, "tier_hit_rate": 0.81, "tier_errors": 0}
    ctx = Context(python=sys.executable, out=tmp_path, work=tmp_path, gpus=1)
    (tmp_path / "kv_tiers.json").write_text(json.dumps(figures))
    status, reason, shown = gpu_check.judge_kv_tiers(ctx, 0, "")
    assert (status, reason) == (PASS, "every goal met")
    assert [f.text() for f in shown] == [
        ("KV tiers: TTFT p50 of turns >= 2, off / on: 5.20x (2,000-token contexts, host-tier hit rate 81%) "
         "(goal >= 4x: met)"),
        "KV tiers: ITL p50 change: +3.1% (p99 +12.0%) (goal <= +5%: met)",
        "KV tiers: answers identical, tier on / off: 24/24 (goal all: met)"]
    (tmp_path / "kv_tiers.json").write_text(json.dumps({**figures, "itl_p50_change": 0.09, "identical": 23}))
    status, reason, _ = gpu_check.judge_kv_tiers(ctx, 0, "")
    assert status == FAIL and reason == ("goal not met: KV tiers: ITL p50 change; "
                                         "KV tiers: answers identical, tier on / off")


def test_steps_picks_steps_and_what_they_need(tmp_path) -> None:
    """``--steps cuda_ipc`` runs the checkpoints it needs and nothing else (each SKIP without CUDA)."""
    out = tmp_path / "out"
    assert gpu_check.main([str(out), "--steps", "cuda_ipc", "--timeout-scale", "2"]) == 0
    report = json.loads((out / "gpu-check.json").read_text())
    assert [(s["name"], s["timeout_s"]) for s in report["steps"]] == [("checkpoints", 100.0), ("cuda_ipc", 190.0)]
