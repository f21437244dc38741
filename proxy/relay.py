"""Dispatch: one client request -> a prefill leg and a decode leg -> one answer.

A request's lifecycle here:
1. parse the body; the router picks a (P, D) pair; the id is tagged with both KV
   addresses and sent as X-Request-Id to both legs.
2. start the legs: ``concurrent`` (both at once, the default) or ``prefill_first``
   (P to its end, then D: vLLM's order).
3. wait until the answer can begin. P failed -> D is cancelled, and a P that refused
   (unreachable, 503) is retried once on another P with a new id. D failed -> P is
   cancelled. The client left -> both are cancelled.
4. relay: non-stream -> D's JSON as is; stream -> D's bytes chunk by chunk, never
   buffered. If P fails after streaming began, the client gets an SSE error event
   and [DONE] (the status line was already sent).
Cancelling a leg closes its connection; the daemons abort a request on disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import anyio
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from common.request_id import make_request_id
from proxy.config import ProxyConfig
from proxy.errors import (BadRequest, ClientDisconnected, ProxyError, RequestTimeout, UpstreamUnreachable,
                          is_retryable)
from proxy.legs import Legs, prefill_body, read_chunks
from proxy.metrics import ProxyMetrics
from proxy.routing import Pair, Router
from proxy.transport import Response as NodeResponse

logger = logging.getLogger(__name__)
_CLIENT_CLOSED = 499  # nginx's status for "client closed request": logged, never sent


@dataclass
class Call:
    """One attempt: a pair, its tagged id, and the legs in flight."""

    pair: Pair
    request_id: str
    start: float
    prefill: asyncio.Task | None = None
    decode: asyncio.Task | None = None
    response: NodeResponse | None = None  # the open decode stream
    tasks: list[asyncio.Task] = field(default_factory=list)
    closed: bool = False

    def spawn(self, coro) -> asyncio.Task:
        task = asyncio.ensure_future(coro)
        task.add_done_callback(_retrieve)
        self.tasks.append(task)
        return task

    async def abort(self) -> None:
        """Cancel whatever still runs and close the decode stream (the nodes see a disconnect)."""
        for task in self.tasks:
            task.cancel()
        d = self.decode
        if self.response is None and d is not None and d.done() and not d.cancelled() and d.exception() is None:
            self.response = d.result()  # opened just as we gave up on it: must still be closed
        if self.response is not None:
            with anyio.CancelScope(shield=True):  # runs while our own task may be cancelled
                await self.response.aclose()


class Dispatcher:
    """Runs requests; one per app, sharing the legs' pooled transport."""

    def __init__(self, legs: Legs, router: Router, config: ProxyConfig, metrics: ProxyMetrics):
        self.legs, self.router, self.config, self.metrics = legs, router, config, metrics

    async def handle(self, request: Request, path: str) -> Response:
        start = time.perf_counter()
        try:
            body_bytes = await request.body()
            body = _parse_body(body_bytes)
        except ProxyError as exc:
            return self._failed(exc, start)
        watcher = asyncio.ensure_future(_wait_disconnect(request))  # only after the body is read
        try:
            async with asyncio.timeout(self.config.total_timeout_s):
                return await self._with_retry(body, body_bytes, path, start, watcher)
        except TimeoutError:
            return self._failed(RequestTimeout(f"request exceeded {self.config.total_timeout_s:g} s"), start)
        except ProxyError as exc:
            return self._failed(exc, start)
        except ClientDisconnected:
            self._finish(None, _CLIENT_CLOSED, start)
            return Response(status_code=_CLIENT_CLOSED)
        finally:
            watcher.cancel()

    async def _with_retry(
        self, body: dict, body_bytes: bytes, path: str, start: float, watcher: asyncio.Task
    ) -> Response:
        model = body.get("model") if isinstance(body.get("model"), str) else None
        p_bytes = prefill_body(body, path)
        stream = body.get("stream") is True
        failed_prefills: set[str] = set()
        while True:
            pair = self.router.pick(model, frozenset(failed_prefills))
            call = Call(pair, make_request_id(pair.prefill.zmq_address, pair.decode.zmq_address), start)
            self.router.begin(pair)
            try:
                self._spawn_prefill(call, path, p_bytes)
                if self.config.dispatch == "prefill_first":
                    await _until(call.prefill, call, watcher)
                if stream:
                    return await self._open_stream(call, path, body_bytes, watcher)
                return await self._run_full(call, path, body_bytes, watcher)
            except ProxyError as exc:
                await self._close(call)
                if failed_prefills or not is_retryable(exc):
                    raise
                failed_prefills.add(pair.prefill.http_address)
                self.metrics.count_retry()
                logger.warning("request %s: prefill refused (%s), retrying on another node", call.request_id, exc)
            except BaseException:
                await self._close(call)
                raise

    def _spawn_prefill(self, call: Call, path: str, p_bytes: bytes) -> None:
        call.prefill = call.spawn(self.legs.prefill(call.pair.prefill, path, p_bytes, call.request_id))

    async def _run_full(self, call: Call, path: str, body_bytes: bytes, watcher: asyncio.Task) -> Response:
        call.decode = call.spawn(self.legs.decode_full(call.pair.decode, path, body_bytes, call.request_id))
        resp = await _until(call.decode, call, watcher)
        await self._close(call)  # a prefill leg still open after D finished has nothing left to do
        self._finish(call, resp.status_code, call.start)
        headers = {"content-type": resp.headers.get("content-type", "application/json"),
                   "x-request-id": call.request_id}
        return Response(resp.content, status_code=resp.status_code, headers=headers)

    async def _open_stream(self, call: Call, path: str, body_bytes: bytes, watcher: asyncio.Task) -> Response:
        decode = call.pair.decode
        call.decode = call.spawn(self.legs.decode_open(decode, path, body_bytes, call.request_id))
        try:
            async with asyncio.timeout(self.config.first_token_timeout_s):
                call.response = await _until(call.decode, call, watcher)
                chunks = read_chunks(call.response, decode.http_address)
                first = await _until(call.spawn(_next(chunks)), call, watcher)
        except TimeoutError as exc:
            raise RequestTimeout(f"decode node {decode.http_address} sent nothing within the first-token "
                                 f"timeout ({self.config.first_token_timeout_s:g} s)") from exc
        if first is None:
            raise UpstreamUnreachable("decode", decode.http_address, "stream ended before any data")
        headers = {"content-type": call.response.headers.get("content-type", "text/event-stream"),
                   "x-request-id": call.request_id}
        return StreamingResponse(self._relay(call, first, chunks), headers=headers)

    async def _relay(self, call: Call, first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        status = _CLIENT_CLOSED  # stays so if the client's disconnect cancels us
        deadline = asyncio.get_running_loop().time() + self.config.total_timeout_s - (time.perf_counter()
                                                                                     - call.start)
        try:
            yield first
            self.metrics.observe_ttft(time.perf_counter() - call.start)
            try:
                # The deadline wraps each read, never a yield: a timeout armed across a yield
                # would fire inside Starlette's send, outside this generator.
                while True:
                    async with asyncio.timeout_at(deadline):
                        chunk = await self._next_relayed(call, chunks)
                    if chunk is None:
                        break
                    yield chunk
                status = 200
            except TimeoutError:
                exc = RequestTimeout(f"request exceeded {self.config.total_timeout_s:g} s")
                status = self._count_error(exc)
                yield exc.sse_event()
            except ProxyError as exc:
                status = self._count_error(exc)
                yield exc.sse_event()
        finally:
            await self._close(call)
            self._finish(call, status, call.start)

    async def _next_relayed(self, call: Call, chunks: AsyncIterator[bytes]) -> bytes | None:
        # While the prefill leg runs, its failure must interrupt the stream; after, read plainly.
        if call.prefill is not None and not call.prefill.done():
            return await _until(call.spawn(_next(chunks)), call, None)
        _raise_if_failed(call.prefill)
        return await _next(chunks)

    async def _close(self, call: Call) -> None:
        if call.closed:
            return
        call.closed = True
        self.router.end(call.pair)
        await call.abort()

    def _failed(self, exc: ProxyError, start: float) -> Response:
        self._finish(None, self._count_error(exc), start, str(exc))
        return exc.response()

    def _count_error(self, exc: ProxyError) -> int:
        self.metrics.count_error(exc.kind)
        return exc.status

    def _finish(self, call: Call | None, status: int, start: float, detail: str = "") -> None:
        latency = time.perf_counter() - start
        self.metrics.observe_request(status, latency)
        if call is None:
            logger.info("request failed status=%d latency=%.1fms %s", status, latency * 1e3, detail)
        else:
            logger.info("request %s P=%s D=%s status=%d latency=%.1fms", call.request_id,
                        call.pair.prefill.http_address, call.pair.decode.http_address, status, latency * 1e3)


async def _until(task: asyncio.Task, call: Call, watcher: asyncio.Task | None):
    """``task``'s result, unless the prefill leg fails or the client leaves first."""
    while not task.done():
        waiting = {task}
        if watcher is not None:
            waiting.add(watcher)
        if call.prefill is not None and call.prefill is not task and not call.prefill.done():
            waiting.add(call.prefill)
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        if watcher is not None and watcher.done():
            raise ClientDisconnected()
        if call.prefill is not task:
            _raise_if_failed(call.prefill)
    return task.result()


def _raise_if_failed(task: asyncio.Task | None) -> None:
    if task is not None and task.done() and not task.cancelled() and task.exception() is not None:
        raise task.exception()


async def _next(chunks: AsyncIterator[bytes]) -> bytes | None:
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _retrieve(task: asyncio.Task) -> None:
    # Legs that fail after being abandoned must not log "exception was never retrieved".
    if not task.cancelled():
        task.exception()


def _parse_body(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    return body
