"""Allowed-token masks of a step's constrained rows, computed on the host and applied on device.

Apart from ``structured_output`` so that compiling a grammar (the serving layer's job,
imported by every CLI command) does not import torch.
"""

from __future__ import annotations

import llguidance
import torch

from common.engine.structured_output import GrammarMatcher

PARALLEL_MASKS = 4  # from this many constrained rows on, llguidance's thread pool computes the masks


class GrammarMasks:
    """Allowed-token masks of a step's constrained rows, computed on the host."""

    def __init__(self) -> None:
        self._executor: llguidance.LLExecutor | None = None  # its thread pool starts on first use

    def allowed(self, matchers: list[GrammarMatcher], vocab_size: int, device: torch.device) -> torch.Tensor:
        """``[len(matchers), vocab_size]`` bool on ``device``: True where the token may follow.
        A matcher may fill several rows (the first tokens of n > 1 choices share one state)."""
        slots = {id(m): m for m in matchers}  # one mask per distinct matcher
        order = {key: i for i, key in enumerate(slots)}
        words = (vocab_size + 31) // 32
        bitmask = torch.empty((len(slots), words), dtype=torch.int32, pin_memory=device.type == "cuda")
        if len(slots) < PARALLEL_MASKS:  # a thread hand-off costs more than a cached mask (~1 µs)
            for key, m in slots.items():
                row = bitmask[order[key]]
                m.ll_matcher.unsafe_compute_mask_ptr(row.data_ptr(), words * 4)
        else:
            if self._executor is None:
                self._executor = llguidance.LLExecutor()
            pairs = [(m.ll_matcher, order[key]) for key, m in slots.items()]
            self._executor.unsafe_compute_mask_ptr(pairs, bitmask.data_ptr(), words * 4, len(slots))
        if len(slots) < len(matchers):
            bitmask = bitmask[[order[id(m)] for m in matchers]]
        bitmask = bitmask.to(device, non_blocking=True)
        shifts = torch.arange(32, device=device, dtype=torch.int32)
        bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # bit j of word w is token 32 w + j
        return bits.reshape(len(matchers), words * 32)[:, :vocab_size].bool()
