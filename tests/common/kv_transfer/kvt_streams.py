"""Fakes for the GPU paths' ordering seam (common/kv_transfer/streams.py), run on CPU.

``RecordingStreams`` logs every stream call into a list that the fake control plane and
the fake pair log into too, so a test reads one timeline: which event was recorded on
which stream, who waited on it, and what went out after.
"""

from __future__ import annotations

import contextlib
import queue
import threading

import torch


class RecordingStreams:
    """A :class:`~common.kv_transfer.streams.StreamOps` that logs; streams are names, events strings."""

    def __init__(self, log: list) -> None:
        self.log = log
        self._events = 0
        self._lock = threading.Lock()

    def current(self, device: torch.device) -> str:
        """Named after the calling thread too: the engine's stream is not the sender's."""
        return f"current:{torch.device(device)}@{threading.current_thread().name}"

    def new_stream(self, device: torch.device) -> str:
        return f"stream:{torch.device(device)}"

    @contextlib.contextmanager
    def use(self, *streams: str):
        self.log.append(("use", *dict.fromkeys(streams)))
        yield

    def record(self, stream: str) -> str:
        with self._lock:
            self._events += 1
            event = f"event{self._events}@{stream}"
        self.log.append(("record", stream, event))
        return event

    def wait(self, stream: str, event: str) -> None:
        self.log.append(("wait", stream, event))

    def synchronize(self, event: str, timeout_s: float) -> bool:
        self.log.append(("synchronize", event))
        return True

    def release_ipc(self) -> None:
        self.log.append(("release_ipc",))


class FakeControl:
    """The producer's control plane: replies are logged (and counted on a condition); calls
    posted to it run in order on a thread of its own, as on the endpoint's I/O thread."""

    def __init__(self, log: list) -> None:
        self.log = log
        self.changed = threading.Condition()
        self.key = None  # keyless: the pairs' hello names the pair id alone
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="fake-io", daemon=True).start()

        self.on_tick = lambda: None  # called between calls, at least every 10 ms

    def call_soon(self, fn) -> None:
        self._calls.put(fn)

    def watch(self, fd, on_readable=None, on_writable=None) -> None:
        pass

    def run_and_wait(self, fn, timeout_s: float) -> bool:
        ran = threading.Event()
        self.call_soon(lambda: (fn(), ran.set()))
        return ran.wait(timeout_s)

    def _loop(self) -> None:
        while True:
            try:
                fn = self._calls.get(timeout=0.01)
            except queue.Empty:
                fn = lambda: None  # noqa: E731
            if fn is None:
                return
            fn()
            self.on_tick()

    def close(self) -> None:
        self._calls.put(None)

    def reply(self, identity: bytes, msg) -> None:
        with self.changed:
            self.log.append(("reply", msg.CMD, getattr(msg, "request_id", "")))
            self.changed.notify_all()

    def wait_for(self, predicate, timeout_s: float = 10.0) -> bool:
        with self.changed:
            return self.changed.wait_for(predicate, timeout_s)


class FakeSendPair:
    """A gloo/nccl pair that logs each send (the tensors it was handed) instead of sending."""

    backend = "nccl"

    def __init__(self, log: list, control: FakeControl) -> None:
        self.log, self.control, self.broken = log, control, False
        self.sent: list[list[torch.Tensor]] = []

    def send_async(self, parts: list[torch.Tensor]):
        with self.control.changed:
            self.sent.append([p.clone() for p in parts])
            self.log.append(("send", len(parts)))
            self.control.changed.notify_all()
        return None

    def wait(self, work, timeout_s: float | None = None) -> None:
        pass

    def close(self) -> None:
        self.broken = True


def index_of(log: list, entry: tuple) -> int:
    """Where ``entry`` first appears in ``log`` (a clear failure when it does not)."""
    assert entry in log, f"{entry} not in {log}"
    return log.index(entry)
