"""Is the node answering a leg still worth waiting for? Checked every second while a leg runs.

A node is lost when the registry evicted it (stopped, or silent past its heartbeat timeout),
or when its heartbeats say its engine has been stuck in one iteration for
``--node-stall-timeout-s`` (a hung kernel, a deadlock: its HTTP server and heartbeats go on,
so nothing else tells it from a busy node). Either way it will not answer, and the timeouts
that would otherwise end the wait (``--prefill-timeout-s``, ``--total-timeout-s``) are minutes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

from common.registry_client import RegistrationMessage
from proxy.errors import ProxyError, UpstreamStalled, UpstreamUnreachable
from proxy.registry import ServiceRegistry

CHECK_INTERVAL_S = 1.0
LostCheck = Callable[[], ProxyError | None]
_T = TypeVar("_T")


def node_lost(registry: ServiceRegistry, role: str, node: RegistrationMessage,
              stall_limit_s: float) -> LostCheck:
    """A check naming why ``node`` (answering the ``role`` leg) is lost, or None while it is not."""
    node_type = "P" if role == "prefill" else "D"

    def lost() -> ProxyError | None:
        current = registry.get(node_type, node.http_address)
        if current is None:
            return UpstreamUnreachable(role, node.http_address, "evicted (no heartbeat) while answering")
        stalled = registry.stalled_for(current)
        if stalled >= stall_limit_s:
            return UpstreamStalled(role, node.http_address, stalled, stall_limit_s)
        return None

    return lost


async def watched(leg: Awaitable[_T], lost: LostCheck) -> _T:
    """``leg``'s result, unless ``lost()`` (checked every second) names a failure first; the leg is
    then cancelled, which closes its connection, and the node aborts the request."""
    task = asyncio.ensure_future(leg)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=CHECK_INTERVAL_S)
            if not task.done() and (error := lost()) is not None:
                raise error
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
