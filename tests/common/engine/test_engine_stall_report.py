"""AsyncLLMEngine.stalled_for: what a daemon's heartbeats report as ``engine_stalled_s``.

A step that never returns (here: the connector worker's poll blocks, as a hung transfer call would)
must show as a growing stall while the event loop and other threads go on; an idle engine and
one that steps normally report 0.
"""

from __future__ import annotations

import asyncio
import threading
import time

from common.engine.async_engine import AsyncLLMEngine
from common.engine.config import EngineConfig
from common.engine.kv_connector import FinishedTransfers, KVConnector, KVConnectorScheduler, KVConnectorWorker
from common.engine.sampling_params import SamplingParams
from helpers.waiting import wait_until


class HangingPoll(KVConnectorWorker):
    """Blocks the engine thread inside ``get_finished`` (called every step) while ``hang`` is set."""

    def __init__(self) -> None:
        self.hang = threading.Event()
        self.release = threading.Event()
        self.hung = threading.Event()

    def get_finished(self) -> FinishedTransfers:
        if self.hang.is_set():
            self.hung.set()
            self.release.wait(60)
        return FinishedTransfers()


def test_a_hung_step_shows_as_a_growing_stall_and_clears_when_it_returns() -> None:
    connector = HangingPoll()
    config = EngineConfig(device="cpu", num_kv_blocks=64, max_num_batched_tokens=64)
    engine = AsyncLLMEngine(config, KVConnector(KVConnectorScheduler(), connector))
    engine.start()
    try:
        wait_until(lambda: engine.stalled_for() == 0.0, "started and asleep: idle is not a stall")
        connector.hang.set()

        async def one_request() -> list[int]:
            tokens: list[int] = []
            async for out in engine.generate("r1", [1, 2, 3, 4], SamplingParams(max_tokens=3, ignore_eos=True)):
                tokens += out.new_token_ids
            return tokens

        async def run() -> list[int]:
            task = asyncio.create_task(one_request())
            while not connector.hung.is_set():
                await asyncio.sleep(0.01)
            first, deadline = engine.stalled_for(), time.monotonic() + 30
            while engine.stalled_for() < first + 0.25:  # grows while the event loop runs on
                assert time.monotonic() < deadline and not task.done()
                await asyncio.sleep(0.01)
            connector.hang.clear()
            connector.release.set()
            return await task

        assert len(asyncio.run(run())) == 3
        wait_until(lambda: engine.stalled_for() == 0.0, "idle again")
    finally:
        connector.release.set()
        engine.shutdown()
