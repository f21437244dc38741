"""``n`` > 1: one request, one prompt pass, n choices.

A request with ``SamplingParams.n`` = n is one ``Sequence`` (choice 0, the request's own id)
until its prompt is computed. The step that samples its first token samples n first tokens
from the same logits row, choice i with ``params.choice(i)`` (its own seed derived from the
request's, so every node draws the same); then the scheduler forks choices 1..n-1: each a
``Sequence`` of its own (id ``choice_request_id``), with the parent's full prompt blocks
shared (one more reference each) and a copy of the block holding the prompt's tail, so
every choice writes its own tokens there. From then on the choices are independent
sequences: each finishes, is preempted or aborted alone, and a block is free again when
its last holder lets go.

Disaggregated, the prefill node samples the n first tokens and hands choices 1..n-1's over
with choice 0's (``Done.choices``); the decode node forks them from the transferred blocks,
so the prompt's KV moves once whatever n is. Every choice's outputs carry the request's id
and the choice's ``index``.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from common.engine.sampler import SampleRow
from common.engine.sequence import Sequence, SequenceStatus

FirstToken = tuple[int, "dict[int, float] | None"]  # a choice's first token and its logprobs


def choice_request_id(request_id: str, index: int) -> str:
    """The engine id of choice ``index`` (choice 0 keeps the request's id: transfers key on it)."""
    return request_id if index == 0 else f"{request_id}#choice{index}"


def wants_choices(seq: Sequence) -> bool:
    """``seq`` samples its first token now and asked for more than one choice."""
    return seq.params.n > 1 and not seq.output_token_ids and not seq.group_id


def expand_rows(logits: torch.Tensor, rows: list[SampleRow], seqs: list[Sequence]
                ) -> tuple[torch.Tensor, list[SampleRow], list[tuple[int, int]]]:
    """Add a sample row (sharing its logits row) for choices 1..n-1 of every sequence that
    samples its first token with n > 1; returns the rows and, per added row, (row, choice)."""
    extra = [(i, c) for i, s in enumerate(seqs) if wants_choices(s) for c in range(1, s.params.n)]
    if not extra:
        return logits, rows, []
    index = torch.tensor(list(range(len(rows))) + [i for i, _ in extra], device=logits.device)
    rows = rows + [replace(rows[i], params=seqs[i].params.choice(c)) for i, c in extra]
    return logits[index], rows, extra


def split_choices(seqs: list[Sequence], token_ids: list[int], logprobs: list, extra: list[tuple[int, int]]
                  ) -> dict[Sequence, list[FirstToken]]:
    """The added rows' tokens, per parent in choice order (``token_ids``/``logprobs`` are cut
    back to the batch's own rows in place)."""
    num_rows = len(seqs)
    firsts: dict[Sequence, list[FirstToken]] = {}
    for k, (row, _) in enumerate(extra):
        firsts.setdefault(seqs[row], []).append((token_ids[num_rows + k], logprobs[num_rows + k]))
    del token_ids[num_rows:], logprobs[num_rows:]
    return firsts


def new_choice(parent: Sequence, index: int, first: FirstToken) -> Sequence:
    """Choice ``index`` of ``parent`` with its first token, its prompt computed, no blocks yet."""
    token, logprobs = first
    params = parent.params.choice(index)
    child = Sequence(choice_request_id(parent.request_id, index), parent.prompt_token_ids, params,
                     num_computed_tokens=parent.num_prompt_tokens, status=SequenceStatus.WAITING,
                     external_kv_checked=True, index=index, group_id=parent.request_id,
                     num_cached_tokens=parent.num_cached_tokens)
    if params.logprobs is not None and logprobs:
        child.logprobs.append(logprobs)
    if parent.grammar is not None:  # forked before the parent's first token advanced it
        child.grammar = parent.grammar.fork()
    return child
