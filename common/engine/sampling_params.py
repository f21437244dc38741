"""Per-request generation settings (vLLM's SamplingParams, trimmed)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from common.engine.structured_output import Grammar

MAX_CACHE_SALT_CHARS = 256
MAX_LOGIT_BIAS = 300  # entries: one step's bias is built from them for every row that has one


class SamplingParamsError(ValueError):
    """A sampling setting is out of range; ``param`` names it for the 400 body."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    # penalties (vLLM's meanings): presence/frequency subtract from the logits of tokens already
    # generated (once / per occurrence); repetition divides the positive and multiplies the negative
    # logits of every token in prompt or output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0  # stop tokens and EOS are masked until this many tokens are generated
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return; None = none
    # a migrated request's prompt ends with this many tokens of its own earlier output: its text
    # (detokenization, stop strings) continues across them instead of treating them as prompt
    resumed_tokens: int = 0
    grammar: Grammar | None = None  # structured output: what the tokens must spell (shared, read-only)
    n: int = 1  # choices: one prompt pass, then the sequence forks (``choice``)
    # not sampling, but it travels with every copy of the request: only requests with the same
    # salt share prefix-cache blocks (tenant isolation, vLLM's request field)
    cache_salt: str | None = None
    # not sampling either: whose request this is, for fair share between clients (fairness.py);
    # set by the node from the API key, cache salt or ``user`` field ("" = the shared pool)
    client: str = ""
    # nor this: another daemon's KV address and how many of the prompt's leading blocks its pool
    # holds (the proxy's hint, the peer tier: kv_tiers.py); set by the node, only for a vouched peer
    kv_peer: tuple[str, int] | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def choice(self, index: int) -> SamplingParams:
        """Choice ``index``'s own settings (n=1): choice 0 keeps the seed, so it answers as n=1
        would; choice i > 0 draws from a seed derived from (seed, i), the same on every node."""
        seed = self.seed if self.seed is None or index == 0 else choice_seed(self.seed, index)
        return replace(self, n=1, seed=seed)

    def validate(self, vocab_size: int | None = None) -> None:
        """Every range (``vocab_size``, when known, bounds ``logit_bias``'s token ids)."""
        if self.n < 1:
            raise SamplingParamsError("n must be at least 1", "n")
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingParamsError("temperature must be in [0, 2]", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p must be in (0, 1]", "top_p")
        if self.top_k < -1:
            raise SamplingParamsError("top_k must be -1 (disabled) or >= 1", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p must be in [0, 1]", "min_p")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(f"{name} must be in [-2, 2]", name)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise SamplingParamsError("repetition_penalty must be a finite number above 0", "repetition_penalty")
        self._validate_logit_bias(vocab_size)
        if self.max_tokens < 1:
            raise SamplingParamsError("max_tokens must be at least 1", "max_tokens")
        if self.min_tokens < 0:
            raise SamplingParamsError("min_tokens must be at least 0", "min_tokens")
        if self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})", "min_tokens"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise SamplingParamsError("logprobs must be in [0, 20]", "logprobs")
        if self.cache_salt is not None and not 0 < len(self.cache_salt) <= MAX_CACHE_SALT_CHARS:
            raise SamplingParamsError(f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters", "cache_salt")


    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}",
                                      "logit_bias")
        for token, bias in self.logit_bias.items():
            if not -100.0 <= bias <= 100.0:
                raise SamplingParamsError(f"logit_bias of token {token} is {bias}; biases must be in [-100, 100]",
                                          "logit_bias")
            if token < 0 or (vocab_size is not None and token >= vocab_size):
                raise SamplingParamsError(f"logit_bias names token {token}, outside the vocabulary [0, {vocab_size})",
                                          "logit_bias")


_MASK64 = 2**64 - 1


def choice_seed(seed: int, index: int) -> int:
    """A signed 64-bit seed for choice ``index`` of a request seeded ``seed`` (splitmix64 of both)."""
    x = (seed * 0x9E3779B97F4A7C15 + index) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x - 2**64 if x >= 2**63 else x
