"""Turns the last-position logits of a batch into next tokens (and logprobs when asked).

One pass over the whole batch, the same torch ops on CPU and GPU: no Python loop over
rows on the device and exactly one device->host copy of the sampled ids per step (plus
one of the logprobs when a row asked for them).

Greedy rows (``temperature == 0`` or ``top_k == 1``) take the exact argmax. Other rows
are scaled by temperature, filtered by top-k then top-p, and sampled with the
exponential race (``argmax(p / E)``, ``E ~ Exp(1)``). A seeded row draws ``E`` from a
counter-based hash of (seed, position of the new token, vocabulary index): the draw is a
function of where the token sits in its sequence, so the prefill node (which samples the
first token) and the decode node (the rest) agree without carrying generator state, and
a seeded request gets the same tokens whatever else is in the batch. Unseeded rows share
the engine's one generator.

Structured outputs: a row with a grammar matcher gets its allowed-token mask (computed on
the host by llguidance, copied once) applied to its logits first; rows without one cost
nothing, and a batch without any skips the step entirely.

``min_tokens`` (vLLM's meaning): until a row has generated that many tokens, its stop
token ids and EOS (unless ``ignore_eos``) are masked out. Then, in vLLM's order,
``logit_bias``, the penalties (``logits_processors.py``), greedy argmax or temperature,
``min_p``, top-k, top-p. Logprobs are the model's raw ones (before temperature and masks),
like vLLM's default.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from common.engine.grammar_masks import GrammarMasks
from common.engine.logits_processors import apply_logit_bias, apply_min_p, apply_penalties
from common.engine.sampling_params import SamplingParams
from common.engine.structured_output import GrammarMatcher

# splitmix64's constants as signed int64 (torch has no uint64 arithmetic; int64 wraps the same)
_GAMMA = 0x9E3779B97F4A7C15 - 2**64
_MIX1 = 0xBF58476D1CE4E5B9 - 2**64
_MIX2 = 0x94D049BB133111EB - 2**64


@dataclass
class SampleRow:
    """One sequence to sample a token for."""

    params: SamplingParams
    position: int  # index the new token takes in prompt + output: a seeded draw depends on it
    num_output_tokens: int = 0  # tokens generated so far (for min_tokens)
    grammar: GrammarMatcher | None = None  # structured output: only the tokens it allows
    # the sequence's own lists (not copies), read only by rows with penalties
    prompt_token_ids: list[int] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row; None where the request did not ask


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, eos_token_ids: Iterable[int] = ()):
        self.device = device
        # unseeded requests share this stream; it is seeded so a whole run is reproducible
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammar_masks = GrammarMasks()

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> SamplerOutput:
        """``logits`` is ``[len(rows), vocab]`` on the sampler's device."""
        logits = logits.float()
        processed = self._mask_stop_tokens(self._mask_grammar(logits, rows), rows)
        processed = apply_penalties(apply_logit_bias(processed, rows, self._to_device), rows, self._to_device)
        token_ids = self._sample(processed, rows)
        ids = token_ids.tolist()  # the step's one device->host copy of the tokens
        return SamplerOutput(ids, self._logprobs(logits, token_ids, ids, rows))

    # ---- sampling ------------------------------------------------------------------
    def _sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        argmax = logits.argmax(dim=-1)
        greedy = [r.params.greedy or r.params.top_k == 1 for r in rows]
        if all(greedy):
            return argmax
        vocab = logits.shape[-1]
        temps = [1.0 if g else r.params.temperature for g, r in zip(greedy, rows)]
        top_ps = [r.params.top_p if r.params.top_p < 1.0 else 2.0 for r in rows]  # 2.0: never cuts
        top_ks = [r.params.top_k if 0 < r.params.top_k < vocab else 0 for r in rows]
        seeds = [_int64(r.params.seed) if r.params.seed is not None else 0 for r in rows]
        seeded = [r.params.seed is not None for r in rows]
        floats = self._to_device([temps, top_ps], torch.float32)
        ints = self._to_device([top_ks, seeds, [r.position for r in rows], greedy, seeded], torch.int64)
        scaled = apply_min_p(logits / floats[0].unsqueeze(1), rows, self._to_device)
        if any(top_ks):
            scaled = _top_k_mask(scaled, ints[0], max(top_ks))
        probs = torch.softmax(scaled, dim=-1)
        if min(top_ps) < 1.0:
            probs = _top_p_filter(probs, floats[1])
        seeded_rows = ints[4].bool()
        noise = self._exponential_noise(probs.shape, ints[1], ints[2], seeded_rows, any(seeded), all(seeded))
        sampled = (probs / noise).argmax(dim=-1)
        return torch.where(ints[3].bool(), argmax, sampled)

    def _exponential_noise(
        self, shape: torch.Size, seeds: torch.Tensor, positions: torch.Tensor, seeded: torch.Tensor,
        any_seeded: bool, all_seeded: bool,
    ) -> torch.Tensor:
        if not any_seeded:
            return torch.empty(shape, device=self.device).exponential_(generator=self.generator)
        hashed = -torch.log(position_uniform(seeds, positions, shape[-1]))
        if all_seeded:
            return hashed
        shared = torch.empty(shape, device=self.device).exponential_(generator=self.generator)
        return torch.where(seeded.unsqueeze(1), hashed, shared)

    def _mask_grammar(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """-inf on the tokens a row's grammar does not allow; unconstrained rows untouched.
        Out of place: logprobs stay the model's."""
        constrained = [i for i, r in enumerate(rows) if r.grammar is not None]
        if not constrained:
            return logits
        allowed = self.grammar_masks.allowed([rows[i].grammar for i in constrained], logits.shape[-1], self.device)
        if len(constrained) == len(rows):
            return logits.masked_fill(~allowed, float("-inf"))
        index = self._to_device([constrained], torch.int64)[0]
        return logits.index_put((index,), logits[index].masked_fill(~allowed, float("-inf")))

    def _mask_stop_tokens(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """-inf on the stop tokens and EOS of rows that have not reached ``min_tokens``."""
        vocab = logits.shape[-1]
        row_idx: list[int] = []
        tok_idx: list[int] = []
        for i, r in enumerate(rows):
            p = r.params
            if r.num_output_tokens >= p.min_tokens:
                continue
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
            for t in stops:
                if 0 <= t < vocab:
                    row_idx.append(i)
                    tok_idx.append(t)
        if not row_idx:
            return logits
        index = self._to_device([row_idx, tok_idx], torch.int64)
        return logits.index_put((index[0], index[1]), torch.tensor(float("-inf"), device=logits.device))

    # ---- logprobs ------------------------------------------------------------------
    def _logprobs(self, logits: torch.Tensor, token_ids: torch.Tensor, ids: list[int], rows: list[SampleRow]
                  ) -> list[dict[int, float] | None]:
        """Chosen-token and top-n logprobs of every row that asked, in one device->host copy."""
        asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
        out: list[dict[int, float] | None] = [None] * len(rows)
        if not asked:
            return out
        if len(asked) < len(rows):
            index = self._to_device([asked], torch.int64)[0]
            logits, token_ids = logits[index], token_ids[index]
        logp = torch.log_softmax(logits, dim=-1)
        parts = [logp.gather(1, token_ids.unsqueeze(1))]
        n_max = max(rows[i].params.logprobs or 0 for i in asked)
        if n_max:
            top = torch.topk(logp, n_max, dim=-1)
            parts += [top.values, top.indices.to(logp.dtype)]  # ids < 2**24: exact in float32
        packed = torch.cat(parts, dim=1).tolist()  # the one copy
        for j, i in enumerate(asked):
            row, n = packed[j], rows[i].params.logprobs or 0
            entry = {int(t): v for t, v in zip(row[1 + n_max : 1 + n_max + n], row[1 : 1 + n])}
            entry[ids[i]] = row[0]  # the chosen token is always reported
            out[i] = entry
        return out

    def _to_device(self, columns: list[list], dtype: torch.dtype) -> torch.Tensor:
        """Per-row host values as one ``[len(columns), rows]`` tensor, copied once."""
        t = torch.tensor(columns, dtype=dtype)
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)


def _int64(seed: int) -> int:
    """Any Python int as a signed 64-bit value (seeds are hashed, so wrapping is fine)."""
    return (seed + 2**63) % 2**64 - 2**63


def _srl(x: torch.Tensor, n: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> n) & ((1 << (64 - n)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's output function on int64 tensors (wrapping arithmetic, as uint64 would)."""
    x = x + _GAMMA
    x = (x ^ _srl(x, 30)) * _MIX1
    x = (x ^ _srl(x, 27)) * _MIX2
    return x ^ _srl(x, 31)


def position_uniform(seeds: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Uniform (0, 1) float32 ``[rows, vocab]``: a pure function of (seed, position, token id)."""
    row_key = splitmix64(splitmix64(seeds) + positions)
    tokens = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    bits = splitmix64(row_key.unsqueeze(1) + tokens * _GAMMA)
    return (_srl(bits, 40).to(torch.float32) + 0.5) * (1.0 / 2**24)  # 24 bits: exact in float32


def _top_k_mask(scaled: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    """Keep each row's ``top_k`` highest values (ties kept); rows with ``top_k`` 0 keep all."""
    values = torch.topk(scaled, k_max, dim=-1).values
    kth = values.gather(1, (top_k.clamp(min=1) - 1).unsqueeze(1))
    kth = torch.where(top_k.unsqueeze(1) > 0, kth, torch.full_like(kth, float("-inf")))
    return scaled.masked_fill(scaled < kth, float("-inf"))


def _top_p_filter(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches its ``top_p``
    (always >= 1 token). The kept probabilities are not renormalized: the race ignores scale."""
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
    mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before >= top_p.unsqueeze(1), 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)
