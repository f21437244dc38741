"""Streaming detokenization: the new text each generated token adds, cheaply.

Decoding the whole output every token costs O(n) per token. Like vLLM's
``detokenize_incrementally`` we decode only a small window: ``prefix_offset`` marks the
tokens already turned into text that still give context (a leading space, a multi-token
character), ``read_offset`` the first token not yet emitted. The delta is
``decode(window) - decode(window prefix)``; text ending in U+FFFD (an incomplete UTF-8
sequence) is held back until a later token completes it.
"""

from __future__ import annotations

from common.model.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5  # prompt tokens kept as decoding context for the first output token
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas; ``add`` per step, ``flush`` at the end."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None,
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = list(prompt_ids or [])[-_CONTEXT_TOKENS:]
        self.prefix_offset = 0
        self.read_offset = len(self.token_ids)
        self.output_ids: list[int] = []

    def _decode(self, start: int, end: int | None = None) -> str:
        return self.tokenizer.decode(self.token_ids[start:end], skip_special_tokens=self.skip_special_tokens)

    def add(self, new_ids: list[int]) -> str:
        """Append generated ids; returns the text they complete (may be empty while held back).

        The ids are taken one at a time, so the text returned so far depends only on the ids,
        never on how they were grouped: a migrated request's replay of the ids a client already
        has (``TextStream``) ends exactly where that client's text ended, even when the ids it
        was sent in one event end inside a multi-byte character."""
        return "".join(self._add_one(token_id) for token_id in new_ids)

    def _add_one(self, token_id: int) -> str:
        self.token_ids.append(token_id)
        self.output_ids.append(token_id)
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_INCOMPLETE):
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Text still held back (an incomplete UTF-8 tail) once generation has ended."""
        prefix_text = self._decode(self.prefix_offset, self.read_offset)
        new_text = self._decode(self.prefix_offset)
        self.prefix_offset = self.read_offset = len(self.token_ids)
        return new_text[len(prefix_text):]
