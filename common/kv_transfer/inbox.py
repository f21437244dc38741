"""A link thread's work queue that also wakes on a data socket.

Every transport's per-pair thread (the producer's sender, the consumer's receiver) waits
here: on the items other threads put (jobs, control-plane notices) and, on a ``tcp`` pair,
on the pair's socket too, so in-band bytes are read the moment they arrive.
"""

from __future__ import annotations

import collections
import queue
import select
import socket
import threading


class Inbox:
    """A thread's work queue; :meth:`get` also returns :data:`READABLE` when the
    data socket it is given has bytes (or its close) to read.

    A wake-up byte is written only when the thread that waits here (the one that calls
    :meth:`get`) may be asleep: not for an item it queues itself, and not while an earlier
    byte is still unread."""

    def __init__(self) -> None:
        self._items: collections.deque = collections.deque()  # append/popleft are thread-safe
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._owner: int | None = None  # the thread that calls get()
        self._signalled = False  # a wake-up byte is written and not yet read

    def put(self, item) -> None:
        self._items.append(item)
        if self._signalled or threading.get_ident() == self._owner:
            return  # a byte is pending already, or the waiting thread queued it itself
        self._signalled = True
        try:
            self._wake_w.send(b"x")
        except OSError:  # the link is gone
            pass

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self):
        try:
            return self._items.popleft()
        except IndexError:
            raise queue.Empty from None

    def get(self, timeout_s: float, data_fd: int | None = None):
        """The next event, :data:`READABLE`, or :class:`queue.Empty` after ``timeout_s``."""
        self._owner = threading.get_ident()
        if self._items:
            return self._items.popleft()
        fds = [self._wake_r] if data_fd is None else [self._wake_r, data_fd]
        ready, _, _ = select.select(fds, [], [], timeout_s)
        if self._wake_r in ready:
            self._signalled = False  # before reading: a put from now on writes a new byte
            self._drain()
        if self._items:  # queued events first: they were there before the bytes were read
            return self._items.popleft()
        if data_fd is not None and data_fd in ready:
            return READABLE
        raise queue.Empty

    def _drain(self) -> None:
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        self._wake_r.close()
        self._wake_w.close()


READABLE = ("data",)
