"""What `pdserve up` leaves in its run directory, and `pdserve down`, which reads it.

``<run-dir>/pids.json`` lists the process groups ``up`` started (name, pid, port, ports,
module, log). ``down`` sends SIGTERM to each group's leader (a tensor-parallel daemon then
stops its worker ranks itself, which share its group), then to whatever is left in a
group whose leader has exited, SIGKILLs each group still not empty after a grace period and
removes the file. It returns once no process of any group is left. A pid is only signalled
while it still runs the module we started, so a stale file never kills a stranger that
reused the pid.
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


def group_alive(pgid: int) -> bool:
    """Does any live (not zombie) process remain in group ``pgid`` (its leader or a child)?"""
    if is_alive(pgid):
        return True  # also reaps the leader when it is our child and has exited
    proc = Path("/proc")
    if not proc.is_dir():  # no /proc (macOS): a zombie left in the group counts as alive
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue  # gone this instant
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            return True
    return False


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def down(run_dir: Path, grace: float = 10.0, quiet: bool = False) -> list[dict]:
    """Stop what ``pids.json`` names (SIGTERM, then SIGKILL after `grace` s).

    Returns the entries that were running; idempotent (nothing running -> []).
    """
    run_dir = Path(run_dir)
    running = [e for e in read_pids(run_dir) if is_ours(e)]
    for entry in running:
        # The leader only: a TP daemon drains and stops its workers (a SIGTERM to them first
        # would read as a lost rank); what its group still holds once it has exited is next.
        _signal(entry["pid"], signal.SIGTERM)
    orphans_signalled: set[int] = set()
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        alive = [e for e in running if group_alive(e["pid"])]
        if not alive:
            break
        for entry in alive:
            if not is_alive(entry["pid"]) and entry["pid"] not in orphans_signalled:
                signal_group(entry["pid"], signal.SIGTERM)
                orphans_signalled.add(entry["pid"])
        time.sleep(0.1)
    for entry in running:
        if group_alive(entry["pid"]):
            signal_group(entry["pid"], signal.SIGKILL)
            entry["killed"] = True
    while any(group_alive(e["pid"]) for e in running) and time.monotonic() < deadline + 5:
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
