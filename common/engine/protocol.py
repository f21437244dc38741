"""The interface the OpenAI serving layer talks to (implemented by ``AsyncLLMEngine``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from common.engine.outputs import RequestOutput
from common.engine.sampling_params import SamplingParams


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int  # includes requests parked waiting for remote KV, or for a KV tier load
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache, ever
    prefix_cache_hits: int = 0  # of those, tokens whose KV was reused
    # what the proxy's adaptive disaggregation weighs (heartbeats carry them)
    prefill_tokens_per_s: float | None = None  # measured (EWMA); None until a prefill step was timed
    pending_prefill_tokens: int = 0  # prompt tokens queued or mid-prefill, not yet computed
    num_decoding: int = 0  # running sequences past their prompt
    max_local_prefill_stall_ms: float | None = None  # the node's bound on a decode step's wait for a prefill
    kv_tiers: dict[str, dict[str, float]] | None = None  # per KV tier ("host", "disk"): KVTiers.stats()

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / max(self.num_total_blocks, 1)


class EngineClient(Protocol):
    model_name: str
    max_model_len: int

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        kv_transfer_params: dict | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield outputs until one has ``finished``. Cancelling the iterator aborts the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...
