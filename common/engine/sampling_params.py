"""Per-request generation settings (vLLM's SamplingParams, trimmed)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    seed: int | None = None
    max_tokens: int = 16
    min_tokens: int = 0  # stop tokens and EOS are masked until this many tokens are generated
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return; None = none

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        if not 0.0 <= self.temperature <= 2.0:
            raise SamplingParamsError("temperature must be in [0, 2]", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p must be in (0, 1]", "top_p")
        if self.top_k < -1:
            raise SamplingParamsError("top_k must be -1 (disabled) or >= 1", "top_k")
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
