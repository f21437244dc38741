"""What the engine measures of its own steps: prefill throughput and a record of each step.

The prefill throughput (tokens per second, an EWMA over steps that computed enough prompt
tokens to be compute-bound) is what the proxy's adaptive disaggregation compares across
nodes, and what turns ``--max-local-prefill-stall-ms`` into a number of prompt tokens a step
may carry while other requests are decoding. The step records (a bounded ring) let tests and
benchmarks check that bound on what the scheduler actually did, not on wall time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MIN_MEASURED_PREFILL_TOKENS = 32  # smaller steps are overhead-bound: they would understate tokens/s
EWMA_WEIGHT = 0.3  # of the newest step


@dataclass(frozen=True)
class StepRecord:
    """One engine step: its rows, its prompt tokens, the prompt-token cap it ran under, its time."""

    num_decode_rows: int  # sequences that generated a token from an already computed prompt
    num_prefill_tokens: int  # prompt tokens computed (local prefill chunks)
    prefill_token_cap: int | None  # the cap that applied because decodes ran too; None: none applied
    prefill_tokens_per_s: float | None  # the throughput the cap was derived from
    seconds: float


class StepMeter:
    """Prefill tokens/s (EWMA) and the last ``keep`` step records."""

    def __init__(self, keep: int = 4096) -> None:
        self.prefill_tokens_per_s: float | None = None
        self.records: deque[StepRecord] = deque(maxlen=keep)

    def stall_token_cap(self, max_stall_ms: float | None, block_size: int) -> int | None:
        """Prompt tokens one step may carry beside running decodes so that it lasts at most
        ``max_stall_ms`` at the measured rate; None when no bound is set or nothing is measured.
        At least one block, so a local prefill always makes progress."""
        if max_stall_ms is None or self.prefill_tokens_per_s is None:
            return None
        return max(block_size, int(self.prefill_tokens_per_s * max_stall_ms / 1000.0))

    def record(self, num_decode_rows: int, num_prefill_tokens: int, cap: int | None, seconds: float) -> None:
        self.records.append(StepRecord(num_decode_rows, num_prefill_tokens, cap, self.prefill_tokens_per_s,
                                       seconds))
        if num_prefill_tokens >= MIN_MEASURED_PREFILL_TOKENS and seconds > 0:
            rate = (num_prefill_tokens + num_decode_rows) / seconds
            old = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if old is None else old + EWMA_WEIGHT * (rate - old)
