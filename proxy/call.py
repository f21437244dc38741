"""One client request's attempts: what outlives an attempt (``Incoming``), one attempt and its
legs in flight (``Call``), and the waits that race a leg against the other leg's failure, the
client's disconnect and the node's eviction (``until``). proxy/relay.py drives them.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from starlette.requests import Request

from proxy.disagg import Decision
from proxy.errors import ClientDisconnected
from proxy.liveness import CHECK_INTERVAL_S, LostCheck
from proxy.routing import Pair
from proxy.transport import Response as NodeResponse


@dataclass
class Incoming:
    """What the client sent that outlives an attempt: its path, its own id, the arrival time."""

    path: str
    client_id: str | None
    start: float
    uid: str = field(default_factory=lambda: uuid.uuid4().hex)  # the first attempt's uuid

    @property
    def id_prefix(self) -> str:
        return "chatcmpl-" if self.path.endswith("/chat/completions") else "cmpl-"

    @property
    def public_id(self) -> str:
        """The id a client sees when no attempt was made (a refusal before routing)."""
        return self.id_prefix + self.uid


@dataclass
class Call:
    """One attempt: a pair, its tagged id (daemons only), its public id, and the legs in flight."""

    pair: Pair
    request_id: str
    public_id: str
    start: float
    prefill: asyncio.Task | None = None
    decode: asyncio.Task | None = None
    response: NodeResponse | None = None  # the open decode stream
    tasks: list[asyncio.Task] = field(default_factory=list)
    closed: bool = False
    client_id: str | None = None
    decision: Decision = Decision("remote", "policy")
    reading: asyncio.Task | None = None  # a read of the decode stream still in flight, to await next

    @property
    def echo_id(self) -> str:
        """The response's X-Request-Id: the client's own, else the id in the body."""
        return self.client_id or self.public_id

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(retrieve)
        self.tasks.append(task)
        return task

    async def abort(self) -> None:
        """Cancel whatever still runs and close the decode stream (the nodes see a disconnect)."""
        for task in self.tasks:
            task.cancel()
        d = self.decode
        opened = d is not None and d.done() and not d.cancelled() and d.exception() is None
        if self.response is None and opened:
            self.response = d.result()  # opened just as we gave up on it: must still be closed
        if self.response is not None and not self.response.released:  # a read answer: nothing to close
            with anyio.CancelScope(shield=True):  # runs while our own task may be cancelled
                await self.response.aclose()


async def until(task: asyncio.Task, call: Call, watcher: asyncio.Task | None,
                 gone: LostCheck | None = None):
    """``task``'s result, unless the prefill leg fails, the client leaves, or ``gone()`` (checked
    every second) says the node answering it was evicted first."""
    while not task.done():
        waiting = {task}
        if watcher is not None:
            waiting.add(watcher)
        if call.prefill is not None and call.prefill is not task and not call.prefill.done():
            waiting.add(call.prefill)
        await first_done(waiting, CHECK_INTERVAL_S if gone is not None else None)
        if watcher is not None and watcher.done():
            raise ClientDisconnected()
        if call.prefill is not task:
            raise_if_failed(call.prefill)
        if gone is not None and not task.done() and (error := gone()) is not None:
            raise error
    return task.result()


async def first_done(futures: set[asyncio.Future], timeout: float | None) -> None:
    """Return once one of ``futures`` is done or ``timeout`` passed: ``asyncio.wait(FIRST_COMPLETED)``
    without the done/pending sets it builds (one such wait per request; it was ~7% of the CPU)."""
    waiter = asyncio.get_running_loop().create_future()

    def wake(_: object = None) -> None:
        if not waiter.done():
            waiter.set_result(None)

    for future in futures:
        future.add_done_callback(wake)
    timer = waiter.get_loop().call_later(timeout, wake) if timeout is not None else None
    try:
        await waiter
    finally:
        if timer is not None:
            timer.cancel()
        for future in futures:
            future.remove_done_callback(wake)


def raise_if_failed(task: asyncio.Task | None) -> None:
    if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()


async def next_chunk(chunks: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


async def wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def retrieve(task: asyncio.Task) -> None:
    # Legs that fail after being abandoned must not log "exception was never retrieved".
    if not task.cancelled():
        task.exception()
