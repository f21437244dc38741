"""``AsyncLLMEngine``: the ``EngineClient`` the serving layer awaits, over a background engine thread.

A request's life: ``generate()`` registers an asyncio queue and posts "add" to the
command queue -> the engine thread (the only thread that touches ``LLMEngine``) drains
commands, steps, and hands each ``RequestOutput`` to the request's queue with
``loop.call_soon_threadsafe`` -> ``generate()`` detokenizes, applies stop strings and
yields. Closing or cancelling the generator (client gone) posts "abort", which frees
the request's blocks.

The thread steps while there is work, and otherwise sleeps on an event until a command
arrives or the KV endpoint calls :meth:`AsyncLLMEngine.wake` (a transfer landed, failed
or freed blocks). While sequences are parked for remote KV or held for a send it also
wakes every ``POLL_INTERVAL_S`` (leases and deadlines are enforced by polling).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import TypeVar

from common.engine.config import EngineConfig
from common.engine.kv_connector import KVConnector
from common.engine.llm_engine import LLMEngine, check_prompt
from common.engine.outputs import RequestOutput
from common.engine.parallel import RANK_MAIN
from common.engine.protocol import EngineStats
from common.engine.sampling_params import SamplingParams
from common.engine.text_stream import TextStream

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 0.005
_T = TypeVar("_T")


def on_a_thread_of_its_own(fn: Callable[[], _T]) -> _T:
    """``fn()`` run on a short-lived thread, its result or exception returned here.

    Why the engine is not built on the caller's (the node's main) thread: the OpenMP thread team
    that a thread's first parallel op creates stays with that thread, and the engine steps on
    another one (``pdserve-engine``), whose ops get a team of their own. Measured on this 2-core
    machine (embedded model, 64 decodes): built on the main thread and stepped on another, a
    decode step took 7.2-8.7 ms; built on a thread that then exits, 4.0-4.4 ms, as when built and
    stepped on one thread (4.3-4.8 ms); served through ``AsyncLLMEngine``, 64 requests of 64 tokens
    ran at 9,400-10,900 tokens/s against 5,700-6,900 (SmolLM2-135M: 633-660 against 401-462)."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller as it is
            box["error"] = e

    thread = threading.Thread(target=run, name="pdserve-engine-build", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


class EngineDeadError(RuntimeError):
    """The engine thread stopped after an unexpected error; the message says which."""


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig, connector: KVConnector | None = None, rank_main: str = RANK_MAIN):
        def build() -> LLMEngine:
            engine = LLMEngine(config, connector, rank_main)
            engine.runner.warm_up_kernels()  # before serving: no request builds one
            return engine

        # tensor parallelism: the rank processes die with the thread that started them (PR_SET_PDEATHSIG
        # names a thread, not a process), so they are started from the caller's thread, which lives on
        self.engine = on_a_thread_of_its_own(build) if config.tensor_parallel_size == 1 else build()
        self.model_name = self.engine.model_name
        self.max_model_len = self.engine.max_model_len
        self.tokenizer = self.engine.tokenizer
        self.kv_layout = self.engine.kv_layout
        self._commands: deque[tuple] = deque()  # deque append/popleft are thread-safe
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _streams
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._stats = self.engine.stats()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._dead: str | None = None
        # called once, from the engine thread, if it stops after an unexpected error: the node
        # stops serving and exits non-zero so a supervisor restarts it (common/node/node.py)
        self.on_dead: Callable[[str], None] = lambda reason: None
        self._busy_since: float | None = None  # when the thread's current iteration with work began
        tiers = self.engine.kv_tiers
        if tiers is not None and tiers.file is not None:
            tiers.file.on_news = self.wake  # a load finished (its request can run), a file came or went (events)

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="pdserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread and finish every open stream with "abort"."""
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
        if self.engine.kv_tiers is not None:
            self.engine.kv_tiers.close()
        self._fail_all_streams("abort", None)

    # ---- EngineClient -------------------------------------------------------------------
    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs (with ``new_text``) until one is finished; closing the generator aborts."""
        self._check_request(prompt_token_ids, params)
        self.start()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        with self._lock:
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already running")
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        texts = [self._text_stream(prompt_token_ids, params) for _ in range(params.n)]  # one per choice
        running = set(range(params.n))
        finished = False
        try:
            self._post(("add", request_id, list(prompt_token_ids), params, kv_transfer_params))
            while not finished:
                out = await queue.get()
                if out.index not in running:
                    continue  # a choice a stop string ended: what it made since is dropped
                text = texts[out.index]
                if text is not None:
                    out.new_text, hit_stop = text.add(out.new_token_ids, out.finished)
                    if hit_stop:
                        out.finish_reason = "stop"
                        if not out.finished:
                            out.finished = True
                            self._post(("abort", request_id, out.index))
                if out.finished:
                    running.discard(out.index)
                finished = not running or out.finish_reason == "error"  # an error ends every choice
                yield out
        finally:
            with self._lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._post(("abort", request_id))

    def _text_stream(self, prompt_token_ids: list[int], params: SamplingParams) -> TextStream | None:
        if self.tokenizer is None:
            return None
        prompt_len = len(prompt_token_ids) - params.resumed_tokens
        text = TextStream(self.tokenizer, prompt_token_ids[:prompt_len], params.stop)
        if params.resumed_tokens:  # replayed, not shown: the client already has this text
            text.add(prompt_token_ids[prompt_len:], False)
        return text

    async def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def stats(self) -> EngineStats:
        """A snapshot the engine thread refreshes every step; the KV tiers' figures read now (their
        threads write files while the engine idles)."""
        tiers = self.engine.kv_tiers
        return self._stats if tiers is None else dataclasses.replace(self._stats, kv_tiers=tiers.stats())

    @property
    def dead_reason(self) -> str | None:
        """Why the engine thread stopped after an unexpected error; None while it runs."""
        return self._dead

    def stalled_for(self) -> float:
        """Seconds the engine thread has spent in its current iteration (0 while it sleeps idle):
        a stuck step (a hung kernel, a deadlock) grows it while the HTTP server and heartbeats
        go on, which is how the proxy tells a stalled node from a busy one."""
        since = self._busy_since
        return 0.0 if since is None else max(0.0, time.monotonic() - since)

    def _check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        # ``params`` are validated where they come in (the serving layer, which names the bad
        # field) and by ``LLMEngine.add_request`` (an error output for any other caller)
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        check_prompt(prompt_token_ids, self.max_model_len)

    def wake(self) -> None:
        """Make the engine thread look again now (a KV transfer landed or freed blocks);
        safe from any thread."""
        self._wake.set()

    def call(self, fn: Callable[[LLMEngine], _T]) -> Future[_T]:
        """``fn(engine)`` run on the engine thread between two steps (a daemon's role flip swaps the
        connector there); the future holds its result or exception."""
        future: Future[_T] = Future()
        self._post(("call", fn, future))
        return future

    def abort_all(self, error: str, code: str) -> int:
        """End every open request with ``error`` (finish reason "error", ``code``) and abort it in
        the engine: a node that stops serving (a role flip's drain ran out) lets the proxy migrate
        them. Returns how many streams were ended."""
        with self._lock:
            ids = list(self._streams)
        self._dispatch([RequestOutput(rid, [], finished=True, finish_reason="error", error=error, error_code=code)
                        for rid in ids])
        for rid in ids:
            self._post(("abort", rid))
        return len(ids)

    def _post(self, command: tuple) -> None:
        self._commands.append(command)
        self._wake.set()

    # ---- the engine thread ------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        try:
            engine.runner.warm_up_thread()
        except Exception:  # noqa: BLE001 - a failed warm-up costs the first request time, not service
            logger.warning("the engine thread's warm-up failed; the first request pays its start", exc_info=True)
        while not self._stopping:
            self._busy_since = time.monotonic()
            self._wake.clear()
            self._apply_commands()
            if engine.has_schedulable_work() or engine.has_pending_transfers():
                try:
                    self._dispatch(engine.poll_transfers())  # a peer's first token goes out before the compute
                    outputs = engine.step()
                except Exception as e:  # noqa: BLE001 - report to every client, then stop
                    logger.exception("engine step failed")
                    self._dead = f"engine step failed: {e!r}"
                    self._fail_all_streams("error", self._dead)
                    self.on_dead(self._dead)
                    return
                self._stats = engine.stats()
                self._dispatch(outputs)
                if not outputs and engine.last_step_num_tokens == 0:
                    # nothing could run (transfers pending, or waiting for blocks they hold): poll, do not spin
                    self._wake.wait(POLL_INTERVAL_S)
            else:
                self._stats = engine.stats()
                self._busy_since = None
                self._wake.wait()

    def _apply_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "abort":
                self.engine.abort_request(*command[1:])
                continue
            if command[0] == "call":
                _, fn, future = command
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - the caller gets it, the engine goes on
                    future.set_exception(e)
                continue
            _, request_id, prompt, params, kv_transfer_params = command
            try:
                self.engine.add_request(request_id, prompt, params, kv_transfer_params)
            except ValueError as e:
                self._dispatch([RequestOutput(request_id, [], finished=True, finish_reason="error", error=str(e))])

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        with self._lock:
            targets = [(self._streams.get(out.request_id), out) for out in outputs]
        for stream, out in targets:
            if stream is None:
                continue  # the client went away; its abort is on its way
            loop, queue = stream
            try:
                loop.call_soon_threadsafe(queue.put_nowait, out)
            except RuntimeError:
                pass  # the client's event loop is closed

    def _fail_all_streams(self, reason: str, error: str | None) -> None:
        with self._lock:
            ids = list(self._streams)
        self._dispatch([RequestOutput(rid, [], finished=True, finish_reason=reason, error=error) for rid in ids])
