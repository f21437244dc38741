"""What the I/O thread must not wait on itself, waited on by a pair's own thread.

The endpoint's I/O thread (control.py) never blocks, but some operations can only be waited
for: torch's gloo work cannot be polled (``get_future`` is not implemented and
``is_completed`` stays False until ``wait``, torch 2.13), NCCL's wait orders the caller's
stream, and a cuda_ipc pair's copies end in an event whose wait is bounded by a deadline.
A :class:`Waiter` runs such waits one after another, in the order given, on a thread of its
own, and hands each outcome (None, or the error) back to the I/O thread as a call.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class Waiter:
    """One pair's blocking waits, in order, on one thread; outcomes come back through ``post``."""

    def __init__(self, name: str, post: Callable[[Callable[[], None]], None]) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._post = post
        threading.Thread(target=self._run, name=f"kv-wait-{name}", daemon=True).start()

    def run(self, wait: Callable[[], object], then: Callable[[BaseException | None], None]) -> None:
        """Call ``wait()`` here, then ``then(error or None)`` on the I/O thread."""
        self._calls.put((wait, then))

    def stop(self) -> None:
        """End the thread after the waits already given (they fail fast on a closed pair)."""
        self._calls.put(None)

    def _run(self) -> None:
        while (call := self._calls.get()) is not None:
            wait, then = call
            error: BaseException | None = None
            try:
                wait()
            except Exception as e:  # PairBrokenError: the pair is done; later waits fail too
                error = e
            self._post(lambda then=then, error=error: then(error))
