"""What `pdserve up` leaves in its run directory, and `pdserve down`, which reads it.

``<run-dir>/pids.json`` lists the process groups ``up`` started (name, pid, port, module,
log). ``down`` sends SIGTERM to each group, SIGKILLs what is left after a grace period
and removes the file. A pid is only signalled while it still runs the module we started,
so a stale file never kills a stranger that reused the pid.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

PIDS_FILE = "pids.json"


def read_pids(run_dir: Path) -> list[dict]:
    """The entries of ``<run_dir>/pids.json``; empty when there is no such file."""
    path = run_dir / PIDS_FILE
    if not path.exists():
        return []
    try:
        entries = json.loads(path.read_text())
    except json.JSONDecodeError:
        return []
    return [e for e in entries if isinstance(e, dict) and isinstance(e.get("pid"), int)]


def write_pids(run_dir: Path, entries: list[dict]) -> None:
    path = run_dir / PIDS_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(entries, indent=2) + "\n")
    tmp.replace(path)


def is_alive(pid: int) -> bool:
    """True while `pid` runs (a zombie child is reaped here and counts as dead)."""
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
        if reaped == pid:
            return False
    except ChildProcessError:
        pass  # not our child: only the kill(0) probe can tell
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _is_zombie(pid)


def _is_zombie(pid: int) -> bool:
    """Exited, but its parent (not us) has not reaped it yet: stopped for our purposes."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc (macOS), or gone this instant
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def is_ours(entry: dict) -> bool:
    """Alive and still running the module we started (guards against pid reuse)."""
    pid = entry["pid"]
    if not is_alive(pid):
        return False
    cmdline = Path(f"/proc/{pid}/cmdline")
    if not cmdline.exists():
        return True  # no /proc (macOS): trust the pid
    try:
        argv = cmdline.read_bytes().split(b"\0")
    except OSError:
        return False
    return entry.get("module", "").encode() in argv


def signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)  # started with start_new_session: pid is the group id
    except (ProcessLookupError, PermissionError):
        pass


def down(run_dir: Path, grace: float = 10.0, quiet: bool = False) -> list[dict]:
    """Stop what ``pids.json`` names (SIGTERM, then SIGKILL after `grace` s).

    Returns the entries that were running; idempotent (nothing running -> []).
    """
    run_dir = Path(run_dir)
    running = [e for e in read_pids(run_dir) if is_ours(e)]
    for entry in running:
        signal_group(entry["pid"], signal.SIGTERM)
    deadline = time.monotonic() + grace
    while any(is_alive(e["pid"]) for e in running) and time.monotonic() < deadline:
        time.sleep(0.1)
    for entry in running:
        if is_alive(entry["pid"]):
            signal_group(entry["pid"], signal.SIGKILL)
            entry["killed"] = True
    while any(is_alive(e["pid"]) for e in running) and time.monotonic() < deadline + 5:
        time.sleep(0.05)
    (run_dir / PIDS_FILE).unlink(missing_ok=True)
    if not quiet:
        _print_stopped(run_dir, running)
    return running


def _print_stopped(run_dir: Path, running: list[dict]) -> None:
    if not running:
        print(f"pdserve: nothing running (no live processes in {run_dir / PIDS_FILE})")
    for entry in running:
        how = "killed" if entry.get("killed") else "stopped"
        print(f"pdserve: {how} {entry['name']} (pid {entry['pid']}, port {entry['port']})")
