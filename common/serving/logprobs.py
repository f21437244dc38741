"""OpenAI logprobs shapes from the engine's per-token ``{token_id: logprob}`` maps."""

from __future__ import annotations

from typing import Any


def _token_text(tokenizer: Any, token_id: int) -> str:
    return tokenizer.decode([token_id])


def completion_logprobs(
    tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float]], text_offset: int = 0
) -> dict[str, Any]:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`` of /v1/completions."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for token_id, candidates in zip(token_ids, logprobs):
        text = _token_text(tokenizer, token_id)
        offsets.append(text_offset)
        text_offset += len(text)
        tokens.append(text)
        token_logprobs.append(candidates.get(token_id))
        top.append({_token_text(tokenizer, t): lp for t, lp in candidates.items()})
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float]],
                  top_n: int) -> dict[str, Any]:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}`` of chat completions.

    ``top_logprobs`` holds exactly the ``top_n`` most likely tokens, as OpenAI's does: the
    engine's map also carries the sampled token when it fell outside them (completions report
    it, up to N+1 entries as vLLM and OpenAI's legacy API do); here it is only ``logprob``.
    """
    content = []
    for token_id, candidates in zip(token_ids, logprobs):
        text = _token_text(tokenizer, token_id)
        top = sorted(candidates.items(), key=lambda item: -item[1])[:top_n]  # stable: ties keep top-k order
        content.append(
            {
                "token": text,
                "logprob": candidates.get(token_id),
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": (t_text := _token_text(tokenizer, t)), "logprob": lp, "bytes": list(t_text.encode())}
                    for t, lp in top
                ],
            }
        )
    return {"content": content}
