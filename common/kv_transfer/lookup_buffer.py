"""vLLM v0's lookup-buffer semantics on top of a :class:`TensorPipe`.

The producer ``insert``s (tokens, roi, key, value, hidden) and returns at once unless the
buffer is full (then it waits: backpressure). The consumer's ``drop_select(tokens, roi)``
blocks until the producer has an entry whose roi-masked tokens share a prefix with the
query's, removes it from the buffer and returns it. ``None`` tokens select any entry.
A handler thread on the producer answers queries; ``close`` on the consumer ends it.
"""

from __future__ import annotations

import collections
import logging
import threading

import torch

from common.kv_transfer.config import PairBrokenError
from common.kv_transfer.pipe import TensorPipe

logger = logging.getLogger(__name__)

Item = list[torch.Tensor | None]  # [tokens, roi, key, value, hidden]


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def prefix_match(item_tokens: torch.Tensor, item_roi: torch.Tensor | None,
                 query_tokens: torch.Tensor | None, query_roi: torch.Tensor | None) -> int:
    """Length of the common prefix of the roi-masked token lists (0 = no match)."""
    if query_tokens is None:
        return 1
    a = item_tokens[item_roi] if item_roi is not None else item_tokens
    b = query_tokens[query_roi] if query_roi is not None else query_tokens
    n = min(len(a), len(b))
    return n if n > 0 and torch.equal(a[:n], b[:n]) else 0


class LookupBuffer:
    """One side of the buffer: the producer calls ``insert``, the consumer ``drop_select``."""

    def __init__(self, pipe: TensorPipe, buffer_size_thresh: int, idle_timeout_s: float = 3600.0) -> None:
        self.pipe = pipe
        self.threshold = buffer_size_thresh
        self.idle_timeout_s = idle_timeout_s
        self.buffer: collections.deque[Item] = collections.deque()
        self.buffer_size = 0
        self._cv = threading.Condition()
        self._handler: threading.Thread | None = None
        self._closed = False

    # ---- producer --------------------------------------------------------------------
    def insert(self, tokens: torch.Tensor, roi: torch.Tensor | None, key: torch.Tensor | None,
               value: torch.Tensor | None, hidden: torch.Tensor | None, timeout_s: float | None = None) -> None:
        """Add an entry (copied). Waits while the buffer is full; TimeoutError after ``timeout_s``."""
        item = [t.clone() if t is not None else None for t in (tokens, roi, key, value, hidden)]
        size = sum(_nbytes(t) for t in item)
        with self._cv:
            # An entry larger than the threshold still goes in once the buffer is empty.
            if not self._cv.wait_for(lambda: self.buffer_size + size <= self.threshold or not self.buffer,
                                     timeout_s):
                raise TimeoutError("lookup buffer full")
            self.buffer.append(item)
            self.buffer_size += size
            self._cv.notify_all()
        if self._handler is None:
            self._handler = threading.Thread(target=self._serve, name="kv-lookup-buffer", daemon=True)
            self._handler.start()

    def _serve(self) -> None:
        try:
            self._serve_forever()
        except PairBrokenError as e:  # the consumer went away; nothing to answer any more
            logger.warning("lookup buffer: pipe failed: %s", e)

    def _serve_forever(self) -> None:
        while True:
            signal = self.pipe.recv_tensor(self.idle_timeout_s)
            if signal is None:  # the consumer closed
                return
            tokens = self.pipe.recv_tensor(self.idle_timeout_s)
            roi = self.pipe.recv_tensor(self.idle_timeout_s)
            with self._cv:
                self._cv.wait_for(lambda: self._find(tokens, roi) is not None)
                item = self._find(tokens, roi)
                del self.buffer[next(i for i, it in enumerate(self.buffer) if it is item)]
                self.buffer_size -= sum(_nbytes(t) for t in item)
                self._cv.notify_all()
            for t in item:
                self.pipe.send_tensor(t)

    def _find(self, tokens: torch.Tensor | None, roi: torch.Tensor | None) -> Item | None:
        for item in self.buffer:
            if prefix_match(item[0], item[1], tokens, roi) > 0:
                return item
        return None

    # ---- consumer --------------------------------------------------------------------
    def drop_select(self, tokens: torch.Tensor | None, roi: torch.Tensor | None,
                    timeout_s: float | None = None) -> Item:
        """Block until the producer hands over a matching entry; returns its five tensors."""
        self.pipe.send_tensor(torch.zeros(1, dtype=torch.int64))
        self.pipe.send_tensor(tokens)
        self.pipe.send_tensor(roi)
        return [self.pipe.recv_tensor(timeout_s or self.idle_timeout_s) for _ in range(5)]

    def close(self) -> None:
        """Consumer: tell the producer's handler to stop. Producer: wait for it to stop."""
        if self._closed:
            return
        self._closed = True
        if self._handler is None:
            self.pipe.send_tensor(None)
        else:
            self._handler.join(self.idle_timeout_s)
