"""The bed itself: hosts reach each other by address, faults are silent and per pair, and
nothing it made outlives it, not even after a run that crashed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers.netns import PREFIX, Bed, ip, unavailable

REASON = unavailable()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"multi-host bed unavailable: {REASON}")

CONNECT = "import socket, sys; socket.create_connection((sys.argv[1], 9), timeout=1)"


def namespaces(mark: str) -> list[str]:
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if mark in line]


def links(name: str) -> list[str]:
    return [line for line in ip("-o", "link", "show").stdout.splitlines() if f" {name}@" in line]


def dial(bed: Bed, src, dst) -> str:
    """How a TCP connect from ``src`` to a closed port on ``dst`` ends: refused = reachable."""
    r = subprocess.run(["ip", "netns", "exec", src.ns, sys.executable, "-c", CONNECT, dst.ip],
                       capture_output=True, text=True, timeout=30)
    if "ConnectionRefused" in r.stderr:
        return "refused"
    return "timeout" if "timed out" in r.stderr else r.stderr


def test_hosts_reach_each_other_cut_is_silent_and_close_removes_everything():
    bed = Bed()
    try:
        a, b, c = bed.add_host("a"), bed.add_host("b"), bed.add_host("c")
        assert dial(bed, a, b) == "refused"  # an answer (RST): the link works
        bed.cut(a, b)
        assert dial(bed, a, b) == "timeout"  # silence, not a refusal
        assert dial(bed, b, a) == "timeout"
        assert dial(bed, a, c) == "refused"  # only that pair is cut
        bed.heal(a, b)
        assert dial(bed, a, b) == "refused"
        assert len(namespaces(f"-{bed.run}-")) == 4 and links(bed.root_link)  # bridge + 3 hosts
    finally:
        bed.close()
    assert namespaces(f"-{bed.run}-") == [] and links(bed.root_link) == []


def test_a_new_bed_removes_what_a_crashed_run_left():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()  # a pid that no longer runs
    stale = f"{PREFIX}-{dead}-0000-leftover"
    ip("netns", "add", stale)
    bed = Bed()
    try:
        assert namespaces(f"-{dead}-") == []
        assert bed.run.startswith(f"{os.getpid()}-")
    finally:
        bed.close()
        ip("netns", "del", stale, check=False)
