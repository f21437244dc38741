"""How bench/gpu_check.py runs a step and reports it: PASS, FAIL or SKIP with the reason.

A step is a command run as its own process group with a timeout, and a judge that reads what
it wrote (exit code, log, a JSON file) into a status, a reason and figures beside their goals.
A step that overruns gets SIGINT (its ``finally`` blocks stop the servers it started), then,
after ``GRACE_S``, SIGKILL for its group and for every process below it (servers that made
their own sessions included), and is marked FAIL "timed out".
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PASS, FAIL, SKIP = "PASS", "FAIL", "SKIP"
NO_CUDA = "no CUDA device"
GRACE_S = 3.0  # between SIGINT and SIGKILL when a step overruns
CLEANUP_TIMEOUT_S = 20.0  # a step's clean-up command (`pdserve down`: SIGTERM, SIGKILL after 10 s)


@dataclass
class Figure:
    """One measured value, and the goal it is held to (if any)."""

    label: str
    value: str
    goal: str = ""
    met: bool | None = None

    def text(self) -> str:
        if not self.goal:
            return f"{self.label}: {self.value}"
        verdict = "" if self.met is None else ": met" if self.met else ": NOT met"
        return f"{self.label}: {self.value} (goal {self.goal}{verdict})"


@dataclass
class StepResult:
    name: str
    title: str
    status: str
    reason: str
    figures: list[Figure] = field(default_factory=list)
    timeout_s: float = 0.0
    wall_s: float = 0.0
    log: str | None = None


@dataclass
class Context:
    """What every step's command and judge may use."""

    python: str
    out: Path
    work: Path  # checkpoints and the steps' own JSON files
    gpus: int = 0
    missing: list[str] = field(default_factory=list)
    probe_error: str | None = None
    deadline: float | None = None  # time.monotonic() by which the whole run must end (its budget)

    def results(self, step: str) -> dict:
        return json.loads((self.work / f"{step}.json").read_text())

    @property
    def checkpoints(self) -> str:
        return str(self.work / "checkpoints")


Verdict = tuple[str, str, list[Figure]]


@dataclass(frozen=True)
class Step:
    name: str
    title: str
    timeout_s: float
    command: Callable[[Context], list[str]]
    judge: Callable[[Context, int, str], Verdict]  # (context, exit code, log text)
    gpus: int = 1
    fewer_gpus: str = NO_CUDA  # the SKIP reason when there are some GPUs, but fewer than ``gpus``
    needs: str | None = None  # a step that must PASS first
    # run after the step, whatever its end: stops what it may have left running outside its tree
    cleanup: Callable[[Context], list[str]] | None = None


# ---------------------------------------------------------------------------- running a step

def step_env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def descendants(root: int) -> set[int]:
    """Every live process below ``root`` (from /proc; empty where there is none)."""
    children: dict[int, list[int]] = {}
    with suppress(OSError):
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                with suppress(OSError, ValueError, IndexError):
                    ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    children.setdefault(ppid, []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def stop_tree(proc: subprocess.Popen) -> None:
    """SIGINT to the step's group, then SIGKILL to it and to all it started (servers that
    made their own sessions included), after ``GRACE_S``."""
    family = descendants(proc.pid)
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGINT)
    with suppress(subprocess.TimeoutExpired):
        proc.wait(GRACE_S)
    family |= descendants(proc.pid)
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    for pid in family:
        with suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def run_command(cmd: list[str], timeout_s: float, log: Path) -> tuple[int | None, float]:
    """(exit code, or None when it ran past ``timeout_s``; seconds it ran); output goes to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env=step_env(), start_new_session=True)
        try:
            code: int | None = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            stop_tree(proc)
            code = None
        except BaseException:  # Ctrl-C on the harness: its step must not outlive it
            stop_tree(proc)
            raise
    return code, time.monotonic() - t0


def skip_reason(step: Step, ctx: Context, done: dict[str, StepResult]) -> str | None:
    if step.gpus and ctx.probe_error is None and ctx.gpus < step.gpus:
        return NO_CUDA if ctx.gpus == 0 else step.fewer_gpus
    if step.needs and done.get(step.needs) and done[step.needs].status != PASS:
        return f"not run: step {step.needs} did not pass"
    if ctx.deadline is not None:  # a step runs only if it ends within the run's budget even if it hangs
        worst = step.timeout_s + GRACE_S + (CLEANUP_TIMEOUT_S if step.cleanup is not None else 0)
        left = ctx.deadline - time.monotonic()
        if worst > left:
            return f"not run: it may take {worst:.0f} s and {max(left, 0):.0f} s of the run's budget are left"
    return None


def run_step(step: Step, ctx: Context, done: dict[str, StepResult]) -> StepResult:
    result = StepResult(step.name, step.title, SKIP, "", timeout_s=step.timeout_s)
    if reason := skip_reason(step, ctx, done):
        result.reason = reason
        return result
    if step.gpus and ctx.probe_error:
        result.status, result.reason = FAIL, f"could not probe the GPU: {ctx.probe_error}"
        return result
    if step.gpus and ctx.missing:
        result.status, result.reason = FAIL, (f"missing Python modules: {', '.join(ctx.missing)} (README, "
                                              "'GPU acceptance': download their wheels and put them on PYTHONPATH)")
        return result
    log = ctx.out / "logs" / f"{step.name}.log"
    result.log = str(log.relative_to(ctx.out))
    code, result.wall_s = run_command(step.command(ctx), step.timeout_s, log)
    if step.cleanup is not None:
        run_command(step.cleanup(ctx), CLEANUP_TIMEOUT_S, log.with_suffix(".cleanup.log"))
    text = log.read_text(errors="replace")
    if code is None:
        result.status, result.reason = FAIL, f"timed out after {step.timeout_s:g} s (see {result.log})"
        return result
    try:
        result.status, result.reason, result.figures = step.judge(ctx, code, text)
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        result.status = FAIL
        result.reason = f"exit {code}, no results to read ({exc!r}): {last_line(text)}"
    return result


def last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip()[:300] if lines else "(no output)"


# ---------------------------------------------------------------------------- the report

def cell(text: str) -> str:
    """Text safe inside one markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def render_table(results: list[StepResult]) -> str:
    """One row per step: its status, its figures beside their goals, the reason, its time."""
    lines = ["| # | step | status | figures (goal) | reason | s / timeout |", "|---|---|---|---|---|---:|"]
    for i, r in enumerate(results, 1):
        figures = "; ".join(f.text() for f in r.figures) or "-"
        took = f"{r.wall_s:.0f} / {r.timeout_s:g}" if r.status != SKIP else f"- / {r.timeout_s:g}"
        lines.append(f"| {i} | {cell(r.title)} | {r.status} | {cell(figures)} | {cell(r.reason)} | {took} |")
    return "\n".join(lines)


def exit_code(results: list[StepResult]) -> int:
    """1 when a step failed; a SKIP is not a failure."""
    return 1 if any(r.status == FAIL for r in results) else 0
