"""Structured outputs: a grammar per sequence that decides which tokens the sampler may pick.

llguidance (MIT, Rust core, CPU only, no torch/transformers at runtime) compiles a JSON
schema into a grammar and keeps one matcher per sequence. A request's life through here:

1. the serving layer compiles ``response_format`` once with :class:`GrammarCompiler` (in a
   worker thread: a big schema takes milliseconds); a schema past the bounds, one that no
   finite JSON value satisfies (``schema_check``) or one llguidance cannot compile is a
   :class:`GrammarError` naming the field (a 400), before any token;
2. the compiled :class:`Grammar` rides in ``SamplingParams.grammar`` (shared, never
   advanced); the engine gives each sequence its own :class:`GrammarMatcher`;
3. each step the sampler asks only the constrained rows for their allowed-token bitmask
   (:class:`~common.engine.grammar_masks.GrammarMasks`, host memory, no device sync) and sets the other tokens' logits
   to -inf; EOS is allowed only where the grammar accepts;
4. the scheduler advances the matcher with every token appended to the sequence, a peer's
   first token included: a decode node rebuilds the state from the tokens (nothing is
   shipped), so its output equals a colocated node's; the sequence finishes ("stop") as
   soon as the grammar is complete. A matcher that fails on a token anyway (llguidance hit one of
   its limits) ends the sequence with an error in our words (:data:`RESPONSE_FORMAT_FAILED`), the
   request's fault (the engine's output names ``Grammar.param``: a 400 or an
   ``invalid_request_error`` event, never a node's); the library's own text goes to the log.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

import llguidance

from common.engine.schema_check import unsatisfiable_refs

MAX_SCHEMA_BYTES = 64 * 1024  # serialized
MAX_SCHEMA_DEPTH = 32  # nested objects/arrays of the schema document itself
SCHEMA_PARAM = "response_format.json_schema.schema"
# What a client is told when a compiled grammar fails mid-answer (llguidance's own text names its
# internals: item limits, lexer states); the field at fault is the request's format
RESPONSE_FORMAT_PARAM = "response_format"
RESPONSE_FORMAT_FAILED = ("the response_format cannot be followed: the grammar engine reached one of its limits "
                          "after {n} output tokens (a schema whose values must nest without end, or a very large "
                          "string pattern, does this); simplify the schema")
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

    def __init__(self, matcher: llguidance.LLMatcher, num_tokens: int = 0):
        self._matcher = matcher
        self._num_tokens = num_tokens  # tokens consumed so far
        self.failed = False  # a token was refused: the sequence ends with ``error``

    def advance(self, token_id: int) -> bool:
        """Consume a generated token; False when the grammar does not allow it, which happens only
        when llguidance gives up (the mask allowed the token): then ``failed`` is set."""
        if self._matcher.consume_token(token_id):
            self._num_tokens += 1
            return True
        self.failed = True
        return False

    @property
    def is_complete(self) -> bool:
        """The grammar accepts and can take nothing more (only EOS would follow)."""
        return self._matcher.is_stopped() and not self._matcher.is_error()

    @property
    def error(self) -> str:
        """What went wrong, in words a client may see (``detail`` has llguidance's own)."""
        return RESPONSE_FORMAT_FAILED.format(n=self._num_tokens) if self.failed else ""

    @property
    def detail(self) -> str:
        """llguidance's message for the failure (its internals: for the node's log only)."""
        return " ".join(self._matcher.get_error().replace("<non-verbose/>", "").split())

    @property
    def ll_matcher(self) -> llguidance.LLMatcher:
        """The llguidance matcher itself, for computing masks in place (grammar_masks)."""
        return self._matcher

    def fork(self) -> GrammarMatcher:
        """An independent copy at the same position (a sequence forked from another)."""
        return GrammarMatcher(self._matcher.deep_copy(), self._num_tokens)


class Grammar:
    """A compiled grammar: the start state every sequence of the request copies; ``param``, the
    request field it came from (named when the grammar cannot be followed)."""

    def __init__(self, kind: str, matcher: llguidance.LLMatcher, param: str = RESPONSE_FORMAT_PARAM):
        self.kind = kind
        self.param = param
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

    def json_schema(self, schema: Any, param: str = SCHEMA_PARAM) -> Grammar:
        """JSON valid under ``schema`` (the request's field ``param``); GrammarError when it is too
        big, too deep, satisfied by no finite value or not compilable."""
        if not isinstance(schema, dict):
            raise GrammarError("the schema must be a JSON object", param)
        if _depth(schema) > MAX_SCHEMA_DEPTH:  # first: serializing a very deep one would recurse
            raise GrammarError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels", param)
        size = len(json.dumps(schema, separators=(",", ":")).encode())
        if size > MAX_SCHEMA_BYTES:
            raise GrammarError(f"the schema is {size} bytes serialized; at most {MAX_SCHEMA_BYTES} are accepted",
                               param)
        # llguidance's own findings first: they are more precise
        grammar = self._compile("json_schema", schema, param, RESPONSE_FORMAT_PARAM if param == SCHEMA_PARAM else param)
        empty = unsatisfiable_refs(schema)
        if empty is not None:
            raise GrammarError(f"no finite JSON value satisfies the schema: every value of {', '.join(empty[:3])} "
                               "must contain another one (a required property or a minItems item leads back to "
                               "it); make the recursion optional", param)
        return grammar

    def _compile(self, kind: str, schema: dict, param: str = SCHEMA_PARAM,
                 runtime_param: str = RESPONSE_FORMAT_PARAM) -> Grammar:
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as exc:
            raise GrammarError(f"the schema cannot be compiled: {_one_line(str(exc))}", param) from None
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0, limits=self._limits)
        if matcher.is_error():
            raise GrammarError(f"the schema cannot be compiled: {_one_line(matcher.get_error())}", param)
        return Grammar(kind, matcher, runtime_param)


def _one_line(message: str) -> str:
    """llguidance's message about the schema, without its layout or its verbosity marker."""
    return " ".join(message.replace("<non-verbose/>", "").split())


def _depth(value: Any, limit: int = MAX_SCHEMA_DEPTH + 1) -> int:
    """Nesting depth of a JSON document, counted no further than ``limit`` (no deep recursion)."""
    depth, level = 0, [value]
    while level and depth < limit:
        depth += 1
        level = [child for item in level if isinstance(item, (dict, list))
                 for child in (item.values() if isinstance(item, dict) else item)
                 if isinstance(child, (dict, list))]
    return depth
