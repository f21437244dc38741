"""The logits processors of vLLM's sampling fields, batched: one set of tensors per step.

Every function takes the batch's ``[rows, vocab]`` logits and returns new ones (the caller's
stay the model's, for logprobs). Per-row settings and token histories are gathered on the
host into flat lists and copied to the device once per step; the work over the vocabulary
is torch ops over all rows together. Rows that do not use a field cost nothing, and a batch
where no row uses it skips it.

- ``logit_bias`` (OpenAI): the bias is added to its token's logit.
- penalties (vLLM's ``apply_penalties``): ``repetition_penalty`` divides the positive and
  multiplies the negative logits of every token seen in prompt or output; then
  ``frequency_penalty`` subtracts per occurrence in the output and ``presence_penalty`` once
  for any occurrence in the output (OpenAI's definitions).
- ``min_p`` (on the temperature-scaled logits, as vLLM applies it): tokens whose probability
  is below ``min_p`` times the row's most likely token's are dropped.

A migrated request's prompt ends with its own earlier output (``resumed_tokens``): those
count as output here, so a resumed stream is penalized as the undisturbed one was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import chain
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from common.engine.sampler import SampleRow

ToDevice = Callable[[list[list], torch.dtype], torch.Tensor]  # host columns -> one device tensor (the sampler's)


def output_history(row: SampleRow) -> Sequence[int]:
    """The tokens this request has generated, the resumed ones included."""
    resumed = row.params.resumed_tokens
    if not resumed:
        return row.output_token_ids
    return row.prompt_token_ids[len(row.prompt_token_ids) - resumed:] + row.output_token_ids


def prompt_history(row: SampleRow) -> Sequence[int]:
    resumed = row.params.resumed_tokens
    return row.prompt_token_ids[: len(row.prompt_token_ids) - resumed] if resumed else row.prompt_token_ids


def apply_logit_bias(logits: torch.Tensor, rows: list[SampleRow], to_device: ToDevice) -> torch.Tensor:
    vocab = logits.shape[-1]
    entries = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias.items() if 0 <= t < vocab]
    if not entries:
        return logits
    row_idx, tok_idx, bias = zip(*entries)
    index = to_device([list(row_idx), list(tok_idx)], torch.int64)
    values = to_device([list(bias)], logits.dtype)[0]
    return logits.index_put((index[0], index[1]), values, accumulate=True)


def apply_penalties(logits: torch.Tensor, rows: list[SampleRow], to_device: ToDevice) -> torch.Tensor:
    picked = [i for i, r in enumerate(rows) if r.params.has_penalties]
    if not picked:
        return logits
    vocab = logits.shape[-1]
    sel = [rows[i] for i in picked]
    outputs = [output_history(r) for r in sel]
    output_counts = _token_counts(outputs, vocab, logits, to_device)
    params = to_device([[r.params.repetition_penalty for r in sel], [r.params.frequency_penalty for r in sel],
                        [r.params.presence_penalty for r in sel]], logits.dtype)
    index = to_device([picked], torch.int64)[0]
    part = logits[index]
    if any(r.params.repetition_penalty != 1.0 for r in sel):
        prompts = [prompt_history(r) if r.params.repetition_penalty != 1.0 else () for r in sel]
        seen = (_token_counts(prompts, vocab, logits, to_device) + output_counts) > 0
        rep = params[0].unsqueeze(1)
        part = torch.where(seen, torch.where(part > 0, part / rep, part * rep), part)
    part = part - params[1].unsqueeze(1) * output_counts - params[2].unsqueeze(1) * (output_counts > 0)
    return logits.index_put((index,), part)


def apply_min_p(scaled: torch.Tensor, rows: list[SampleRow], to_device: ToDevice) -> torch.Tensor:
    min_ps = [r.params.min_p for r in rows]
    if not any(min_ps):
        return scaled
    probs = torch.softmax(scaled, dim=-1)
    floor = probs.amax(dim=-1, keepdim=True) * to_device([min_ps], probs.dtype)[0].unsqueeze(1)
    return scaled.masked_fill(probs < floor, float("-inf"))


def _token_counts(histories: list[Sequence[int]], vocab: int, like: torch.Tensor,
                  to_device: ToDevice) -> torch.Tensor:
    """``[len(histories), vocab]`` occurrence counts, from one flat copy of the tokens (and of
    each history's row). A token id the head cannot produce lands in a dropped extra column."""
    counts = torch.zeros(len(histories), vocab + 1, dtype=like.dtype, device=like.device)
    if not any(histories):
        return counts[:, :vocab]
    flat = to_device([list(chain.from_iterable(histories)),
                      list(chain.from_iterable([i] * len(h) for i, h in enumerate(histories)))], torch.int64)
    tokens = flat[0].clamp(0, vocab)
    counts.index_put_((flat[1], tokens), torch.ones_like(tokens, dtype=like.dtype), accumulate=True)
    return counts[:, :vocab]
