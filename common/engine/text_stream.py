"""Per-request text output: incremental detokenization with stop strings applied.

The text is cut just before the first stop string. While generation goes on, a tail
that could still grow into a stop string is held back, so no client ever sees text that
a later token reveals to be part of a stop string.
"""

from __future__ import annotations

from common.model.detokenizer import IncrementalDetokenizer
from common.model.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], stop: list[str]):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stop = [s for s in stop if s]
        self._text = ""
        self._emitted = 0  # characters of _text already returned

    def add(self, token_ids: list[int], finished: bool) -> tuple[str, bool]:
        """Return the new text to show and whether a stop string ended the output."""
        self._text += self._detok.add(token_ids)
        if finished:
            self._text += self._detok.flush()
        cut = self._find_stop()
        if cut is not None:
            return self._emit(cut), True
        end = len(self._text) if finished else len(self._text) - self._held_back()
        return self._emit(end), False

    @property
    def text(self) -> str:
        return self._text[: self._emitted]

    def _emit(self, end: int) -> str:
        end = max(end, self._emitted)
        delta = self._text[self._emitted : end]
        self._emitted = end
        return delta

    def _find_stop(self) -> int | None:
        if not self._stop:
            return None
        start = max(0, self._emitted - max(map(len, self._stop)) + 1)
        hits = [i for s in self._stop if (i := self._text.find(s, start)) != -1]
        return min(hits) if hits else None

    def _held_back(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string."""
        longest = max((len(s) for s in self._stop), default=1) - 1
        for k in range(min(longest, len(self._text)), 0, -1):
            tail = self._text[-k:]
            if any(s.startswith(tail) for s in self._stop):
                return k
        return 0
