"""Free TCP ports on 127.0.0.1 for the processes and servers a test starts.

Under pytest-xdist (``make test`` runs two workers) the workers choose from disjoint ranges
below the kernel's ephemeral range: a port one worker chose and released a moment before its
server binds it can then never be handed to the other worker's server in between. Within a
worker, a port handed out is not handed out again in the same run (a run of consecutive ports,
a tensor-parallel daemon's KV endpoints, counts whole): a port handed out but not yet bound was
once handed to a second node, whose start then failed while the first answered for it.
"""

from __future__ import annotations

import os
import random
import socket

_SPAN = 5000  # ports a worker chooses from: worker N has [10000 + N * _SPAN, 10000 + (N + 1) * _SPAN)
_handed_out: set[int] = set()  # this process's ports so far: never drawn again while others are left


def _worker_range() -> range | None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")  # "gw0", "gw1", ...; unset without xdist
    if not worker.startswith("gw") or not worker[2:].isdigit() or int(worker[2:]) >= 4:
        return None
    start = 10000 + int(worker[2:]) * _SPAN
    return range(start, start + _SPAN)


def _draw(ports: range | None) -> int:
    """A port to try: from the worker's range, one not handed out yet (0: the kernel's choice)."""
    if ports is None:
        return 0
    if len(_handed_out) > len(ports) // 2:  # a very long run: start over rather than search a full range
        _handed_out.clear()
    while True:
        port = random.choice(ports)
        if port not in _handed_out:
            return port


def free_ports(count: int) -> list[int]:
    """``count`` distinct ports that were free a moment ago and not handed out before in this run."""
    ports = _worker_range()
    socks: list[socket.socket] = []
    try:
        while len(socks) < count:
            sock = socket.socket()
            try:
                sock.bind(("127.0.0.1", _draw(ports)))
            except OSError:  # taken: another draw
                sock.close()
                continue
            if sock.getsockname()[1] in _handed_out:  # the kernel's choice, handed out before
                sock.close()
                continue
            socks.append(sock)
        chosen = [sock.getsockname()[1] for sock in socks]
        _handed_out.update(chosen)
        return chosen
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
                if port in _handed_out:
                    raise OSError("handed out before")
                sock = socket.socket()
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            _handed_out.update(range(first + 1, first + count))
            return first
        except OSError:
            continue  # one of the next ports is taken: another draw
        finally:
            for sock in socks:
                sock.close()
