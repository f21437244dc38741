"""A link with a fixed one-way delay and random loss, in user space: where the kernel has no netem.

Opens a TAP device named ``DEV`` in each of two network namespaces and copies every
Ethernet frame from one to the other after ``DELAY_MS`` (FIFO, so order is kept),
dropping each with probability ``LOSS`` (0..1). New values are read from stdin, one
"DELAY_MS LOSS" per line. Prints "ready" once both devices exist; they vanish when the
process ends.

    python delay_relay.py NS_A NS_B DEV DELAY_MS LOSS
"""

from __future__ import annotations

import collections
import ctypes
import fcntl
import os
import random
import struct
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000
CLONE_NEWNET = 0x40000000


def open_tap(netns: str, name: str) -> int:
    """A TAP device created inside ``netns`` (this thread enters it first)."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(f"/var/run/netns/{netns}") as f:
        if libc.setns(f.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns {netns}")
    fd = os.open("/dev/net/tun", os.O_RDWR)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


class Direction:
    """Frames read from ``src`` are written to ``dst`` ``impair[0]`` seconds later, unless
    dropped (probability ``impair[1]``)."""

    def __init__(self, src: int, dst: int, impair: list[float]) -> None:
        self.src, self.dst, self.impair = src, dst, impair
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()

    def read(self) -> None:
        while True:
            frame = os.read(self.src, 70000)
            if random.random() < self.impair[1]:
                continue
            with self.ready:
                self.queue.append((time.monotonic() + self.impair[0], frame))
                self.ready.notify()

    def write(self) -> None:
        while True:
            with self.ready:
                while not self.queue:
                    self.ready.wait()
                due, frame = self.queue.popleft()
            wait = due - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            try:
                os.write(self.dst, frame)
            except OSError:
                pass  # the far device is down for a moment: a lost frame, as on a wire


def main() -> None:
    ns_a, ns_b, dev, delay_ms, loss = sys.argv[1:6]
    impair = [float(delay_ms) / 1000, float(loss)]
    a, b = open_tap(ns_a, dev), open_tap(ns_b, dev)
    for direction in (Direction(a, b, impair), Direction(b, a, impair)):
        for target in (direction.read, direction.write):
            threading.Thread(target=target, daemon=True).start()
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip():
            delay_ms, loss = line.split()
            impair[:] = [float(delay_ms) / 1000, float(loss)]


if __name__ == "__main__":
    main()
