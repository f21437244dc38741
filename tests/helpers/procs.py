"""Processes as /proc shows them: a process's children, and whether one has ended."""

from __future__ import annotations

from pathlib import Path


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``, in pid order."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return sorted(found)


def gone(pid: int) -> bool:
    """``pid`` has exited (or is a zombie its dead parent's reaper has not reaped yet)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"
