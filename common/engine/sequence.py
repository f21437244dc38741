"""One request's state inside the engine (what the scheduler, runner and connector see)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from common.engine.outputs import FinishReason
from typing import TYPE_CHECKING

from common.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from common.engine.structured_output import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # queued; prefill (or a preempted recompute) not finished
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # holds blocks, KV arriving from a peer
    LOADING_KV = "loading_kv"  # holds blocks, KV of its prefix being read from a tier (kv_tiers)
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Prompt + generated tokens, the blocks holding their KV, and how far the KV is computed.

    ``num_computed_tokens`` counts tokens whose KV is in the cache. A step computes
    ``num_tokens - num_computed_tokens`` tokens (or a chunk of them); when it reaches
    ``num_tokens`` the step samples a new token. A decode step thus feeds the last
    sampled token; a preempted sequence (``num_computed_tokens`` reset to 0) recomputes
    prompt + generated tokens and carries on without repeating any output.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    kv_transfer_params: dict = field(default_factory=dict)
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    external_kv_checked: bool = False  # asked the connector once; a recompute never asks again
    tiers_checked: bool = False  # loaded from the KV tiers once (kv_tiers): a failed load is not retried
    num_preemptions: int = 0
    num_emitted_tokens: int = 0  # output tokens already handed out in a RequestOutput
    logprobs: list[dict[int, float]] = field(default_factory=list)  # per output token, when asked
    block_hashes: list[bytes] = field(default_factory=list)  # prefix caching: names of its full blocks
    num_cached_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    # prompt tokens served from the prefix cache where the prompt was computed (a remote
    # prefill: the prefill node's count, from DONE); usage.prompt_tokens_details.cached_tokens
    num_cached_tokens: int = 0
    # n > 1 (common/engine/choices.py): choice ``index`` of request ``group_id`` ("" = its own);
    # choice 0 keeps the first tokens of the others it forked, for a prefill node's hand-over
    index: int = 0
    group_id: str = ""
    choice_firsts: list[tuple[int, dict[int, float] | None]] = field(default_factory=list)
    grammar: GrammarMatcher | None = None  # its own matcher of params.grammar (a fork copies it: fork())

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing prompt (or recompute) tokens, i.e. more than one token to go."""
        return self.num_computed_tokens < self.num_tokens - 1 or not self.output_token_ids

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens ``[start, end)`` of prompt + output without concatenating the whole lists."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
