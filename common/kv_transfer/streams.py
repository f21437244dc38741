"""How the GPU data planes order their work across streams: one small seam.

The KV of a layer is written on the engine's stream and read by a transfer running on
another stream (or another process). Four rules keep the bytes whole, and every GPU path
expresses them through a :class:`StreamOps`, so a CPU test can check their order with a
recording fake:

- **send after gather** (gloo/nccl): the engine records an event after it wrote or gathered
  a layer; the sender's stream waits on it before gathering or sending (NCCL orders its
  own stream after the caller's current stream, so that wait covers the send);
- **copy on the destination's stream** (cuda_ipc): the copy into the consumer's blocks ends
  on a stream of the *destination* device (``index_copy_`` runs there, and torch makes it
  wait for a cross-device copy), an event is recorded on that stream, and DONE goes out
  only once it completed;
- **fence before free** (cuda_ipc): blocks the producer may still write into are reused
  only after the producer reported that stream drained (see receiver.py);
- **drain before unmap** (cuda_ipc): a pair drops its mapping of the consumer's cache
  only after its streams drained, then releases what CUDA IPC still holds.

:class:`CudaStreams` does it with ``torch.cuda``; on CPU work is synchronous and
:class:`NoStreams` does nothing.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any, Protocol

import torch


class StreamOps(Protocol):
    """Streams and events as opaque handles; an event of ``None`` is nothing to wait for."""

    def current(self, device: torch.device) -> Any:
        """The calling thread's current stream on ``device`` (the one NCCL orders after)."""

    def new_stream(self, device: torch.device) -> Any:
        """A stream of its own on ``device``."""

    def use(self, *streams: Any) -> contextlib.AbstractContextManager:
        """Make ``streams`` current (one per device) for the calling thread, in a ``with``."""

    def record(self, stream: Any) -> Any:
        """An event after everything queued on ``stream`` so far."""

    def wait(self, stream: Any, event: Any) -> None:
        """Work queued on ``stream`` from now on runs after ``event``."""

    def synchronize(self, event: Any, timeout_s: float) -> bool:
        """Block until ``event`` completed; False if ``timeout_s`` passed first."""

    def release_ipc(self) -> None:
        """Let CUDA IPC release what dropped mappings still hold."""


class CudaStreams:
    """:class:`StreamOps` on ``torch.cuda``."""

    def current(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.Stream(device=device)

    @contextlib.contextmanager
    def use(self, *streams: torch.cuda.Stream) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for s in dict.fromkeys(streams):  # the same stream twice: entered once
                stack.enter_context(torch.cuda.stream(s))
            yield

    def record(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        return stream.record_event()

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def synchronize(self, event: torch.cuda.Event, timeout_s: float) -> bool:
        # poll, not event.synchronize(): a wedged copy must fail the pair, not hang the thread;
        # the first millisecond only yields (a short copy's end is seen at once), then naps
        start = time.monotonic()
        while not event.query():
            waited = time.monotonic() - start
            if waited > timeout_s:
                return False
            time.sleep(0 if waited < 0.001 else 0.0002)
        return True

    def release_ipc(self) -> None:
        torch.cuda.ipc_collect()


class NoStreams:
    """:class:`StreamOps` on CPU: work is done when the call returns; nothing to order."""

    def current(self, device: torch.device) -> str:
        return "cpu"

    def new_stream(self, device: torch.device) -> str:
        return "cpu"

    def use(self, *streams: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def record(self, stream: Any) -> None:
        return None

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def synchronize(self, event: Any, timeout_s: float) -> bool:
        return True

    def release_ipc(self) -> None:
        pass


def stream_ops(device: str | torch.device) -> StreamOps:
    """The :class:`StreamOps` for a KV cache on ``device``."""
    return CudaStreams() if torch.device(device).type == "cuda" else NoStreams()
