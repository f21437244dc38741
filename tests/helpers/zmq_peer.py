"""A raw ZMQ DEALER aimed at one of our ROUTERs: what a stranger (or vLLM's daemon) sends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import zmq


@contextlib.contextmanager
def raw_dealer(address: str) -> Iterator[zmq.Socket]:
    """A DEALER connected to ``host:port``, closed (no linger) on exit."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://{address}")
    try:
        yield sock
    finally:
        sock.close()
        ctx.term()
