"""Structured outputs: a grammar per sequence that decides which tokens the sampler may pick.

llguidance (MIT, Rust core, CPU only, no torch/transformers at runtime) compiles a JSON
schema into a grammar and keeps one matcher per sequence. A request's life through here:

1. the serving layer compiles ``response_format`` once with :class:`GrammarCompiler` (in a
   worker thread: a big schema takes milliseconds); a schema past the bounds or one
   llguidance cannot compile is a :class:`GrammarError` naming the field (a 400);
2. the compiled :class:`Grammar` rides in ``SamplingParams.grammar`` (shared, never
   advanced); the engine gives each sequence its own :class:`GrammarMatcher`;
3. each step the sampler asks only the constrained rows for their allowed-token bitmask
   (:class:`~common.engine.grammar_masks.GrammarMasks`, host memory, no device sync) and sets the other tokens' logits
   to -inf; EOS is allowed only where the grammar accepts;
4. the scheduler advances the matcher with every token appended to the sequence, a peer's
   first token included: a decode node rebuilds the state from the tokens (nothing is
   shipped), so its output equals a colocated node's; the sequence finishes ("stop") as
   soon as the grammar is complete.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import llguidance

MAX_SCHEMA_BYTES = 64 * 1024  # serialized
MAX_SCHEMA_DEPTH = 32  # nested objects/arrays of the schema document itself
SCHEMA_PARAM = "response_format.json_schema.schema"
# OpenAI's strict mode and every small model do best with compact JSON; flexible whitespace
# also lets a model pad forever with newlines before it closes the object
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """The grammar cannot be built; ``param`` names the request field for the 400 body."""

    def __init__(self, message: str, param: str = SCHEMA_PARAM):
        super().__init__(message)
        self.param = param


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher):
        self._matcher = matcher

    def advance(self, token_id: int) -> bool:
        """Consume a generated token; False when the grammar does not allow it."""
        return self._matcher.consume_token(token_id)

    @property
    def is_complete(self) -> bool:
        """The grammar accepts and can take nothing more (only EOS would follow)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher itself, for computing masks in place (grammar_masks)."""
        return self._matcher

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position (a sequence forked from another)."""
        return GrammarMatcher(self._matcher.deep_copy())


class Grammar:
    """A compiled grammar: the start state every sequence of the request copies."""

    def __init__(self, kind: str, matcher: llguidance.LLMatcher):
        self.kind = kind
        self._start = matcher

    def matcher(self) -> GrammarMatcher:
        return GrammarMatcher(self._start.deep_copy())


class GrammarCompiler:
    """Builds grammars for one tokenizer (``tokenizer.json`` text) and logits width."""

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: Iterable[int]):
        self._tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab_size,
                                                 eos_token=sorted(set(eos_token_ids)) or None)
        self._limits = llguidance.LLParserLimits(verbose_errors=False)  # no grammar dumps in 400s

    def json_object(self) -> Grammar:
        """Any JSON object (``{"type": "json_object"}``)."""
        return self._compile("json_object", {"type": "object"})

    def json_schema(self, schema: Any) -> Grammar:
        """JSON valid under ``schema``; GrammarError when it is too big, too deep or not compilable."""
        if not isinstance(schema, dict):
            raise GrammarError("the schema must be a JSON object")
        if _depth(schema) > MAX_SCHEMA_DEPTH:  # first: serializing a very deep one would recurse
            raise GrammarError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        size = len(json.dumps(schema, separators=(",", ":")).encode())
        if size > MAX_SCHEMA_BYTES:
            raise GrammarError(f"the schema is {size} bytes serialized; at most {MAX_SCHEMA_BYTES} are accepted")
        return self._compile("json_schema", schema)

    def _compile(self, kind: str, schema: dict) -> Grammar:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"the schema cannot be compiled: {exc}") from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(f"the schema cannot be compiled: {matcher.get_error()}")
        return Grammar(kind, matcher)


def _depth(value: Any, limit: int = MAX_SCHEMA_DEPTH + 1) -> int:
    """Nesting depth of a JSON document, counted no further than ``limit`` (no deep recursion)."""
    depth, level = 0, [value]
    while level and depth < limit:
        depth += 1
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]
    return depth
