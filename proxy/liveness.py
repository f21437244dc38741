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
    then cancelled, which closes its connection, and the node aborts the request.

    Runs ``leg`` in the calling task (which must be one of its own, as ``Call.spawn`` makes) with a
    timer beside it: no second task and no ``asyncio.wait`` per leg (~6% of the proxy's CPU per
    request went to those)."""
    task = asyncio.current_task()
    assert task is not None
    loop = asyncio.get_running_loop()
    error: ProxyError | None = None

    def check() -> None:
        nonlocal error, timer
        error = lost()
        if error is not None:
            task.cancel()
        else:
            timer = loop.call_later(CHECK_INTERVAL_S, check)

    timer = loop.call_later(CHECK_INTERVAL_S, check)
    try:
        return await leg
    except asyncio.CancelledError:
        if error is None:
            raise
        task.uncancel()
        raise error from None
    finally:
        timer.cancel()
