"""Turns the last-position logits of a batch into next tokens (and logprobs when asked).

Greedy rows (``temperature == 0``) take the exact argmax. Other rows are scaled by
temperature, filtered by top-k then top-p, and sampled with the exponential-race trick
(``argmax(p / Exp(1))``) drawn from the request's own ``torch.Generator`` when it set a
seed, so a seeded request gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.engine.sampling_params import SamplingParams


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row; None where the request did not ask


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0):
        # unseeded requests share this stream; it is seeded so a whole run is reproducible
        self.default_generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(
        self, logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]
    ) -> SamplerOutput:
        """``logits`` is float32 ``[num_rows, vocab]``; one params/generator per row."""
        token_ids = logits.argmax(dim=-1)
        sampled_rows = [i for i, p in enumerate(params) if not p.greedy and p.top_k != 1]
        if sampled_rows:
            token_ids = token_ids.clone()
            for i in sampled_rows:
                token_ids[i] = self._sample_row(logits[i], params[i], generators[i] or self.default_generator)
        ids = token_ids.tolist()
        return SamplerOutput(ids, self._logprobs(logits, ids, params))

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator) -> torch.Tensor:
        scaled = logits / p.temperature
        if p.top_k > 0 and p.top_k < scaled.numel():
            kth = torch.topk(scaled, p.top_k).values[-1]
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        probs = torch.softmax(scaled, dim=-1)
        if p.top_p < 1.0:
            probs = _top_p_filter(probs, p.top_p)
        noise = torch.empty_like(probs).exponential_(generator=generator)
        return (probs / noise).argmax()

    @staticmethod
    def _logprobs(logits: torch.Tensor, ids: list[int], params: list[SamplingParams]) -> list[dict[int, float] | None]:
        rows = [i for i, p in enumerate(params) if p.logprobs is not None]
        out: list[dict[int, float] | None] = [None] * len(params)
        if not rows:
            return out
        logp = torch.log_softmax(logits[rows], dim=-1)
        for j, i in enumerate(rows):
            n = params[i].logprobs or 0
            entry: dict[int, float] = {}
            if n > 0:
                top = torch.topk(logp[j], n)
                entry = dict(zip(top.indices.tolist(), top.values.tolist()))
            entry[ids[i]] = logp[j, ids[i]].item()  # the chosen token is always reported
            out[i] = entry
        return out


def _top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches ``top_p`` (always >= 1 token)."""
    sorted_probs, order = torch.sort(probs, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
