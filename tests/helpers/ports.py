"""Free TCP ports on 127.0.0.1 for the processes and servers a test starts.

Under pytest-xdist (``make test`` runs two workers) the workers choose from disjoint ranges
below the kernel's ephemeral range: a port one worker chose and released a moment before its
server binds it can then never be handed to the other worker's server in between.
"""

from __future__ import annotations

import os
import random
import socket

_SPAN = 5000  # ports a worker chooses from: worker N has [10000 + N * _SPAN, 10000 + (N + 1) * _SPAN)


def _worker_range() -> range | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...; unset without xdist
    if not worker.startswith("gw") or not worker[2:].isdigit() or int(worker[2:]) >= 4:
        return None
    start = 10000 + int(worker[2:]) * _SPAN
    return range(start, start + _SPAN)


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago (all held while choosing, so no repeats)."""
    ports = _worker_range()
    socks: list[socket.socket] = []
    try:
        while len(socks) < count:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", random.choice(ports) if ports is not None else 0))
            except OSError:  # taken: another draw
                sock.close()
                continue
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


def free_port() -> int:
    return free_ports(1)[0]


def free_port_run(count: int) -> int:
    """The first of ``count`` consecutive ports that were free a moment ago (a tensor-parallel
    daemon's KV endpoints: ``--kv-port`` + rank)."""
    while True:
        first = free_port()
        socks: list[socket.socket] = []
        try:
            for port in range(first + 1, first + count):
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue  # one of the next ports is taken: another draw
        finally:
            for sock in socks:
                sock.close()
