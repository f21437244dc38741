"""``response_format`` -> a compiled :class:`~common.engine.structured_output.Grammar`.

Every node compiles the request it gets for its own tokenizer (a prefill node and a decode
node get the same body from the proxy), so no grammar travels between processes.
Compiling runs in a worker thread: a large schema takes milliseconds, and llguidance
releases the GIL while it builds the lexer. A schema it cannot compile, one no finite value
satisfies, or one past the size/depth bounds, is a 400 naming
``response_format.json_schema.schema``, before any token.
"""

from __future__ import annotations

import asyncio
from typing import Any

from common.engine.structured_output import Grammar, GrammarCompiler, GrammarError
from common.serving.errors import OpenAIError
from common.serving.protocol import ResponseFormat


class ResponseFormats:
    """One node's grammar compiler, built on first use (most requests never need it)."""

    def __init__(self, tokenizer: Any, vocab_size: int | None) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._compiler: GrammarCompiler | None = None
        self._json_object: Grammar | None = None  # the same for every request: compiled once

    async def grammar(self, fmt: ResponseFormat | None) -> Grammar | None:
        """The grammar ``fmt`` asks for; None for plain text."""
        if fmt is None or fmt.type == "text":
            return None
        try:
            if fmt.type == "json_object":
                if self._json_object is None:
                    self._json_object = await asyncio.to_thread(self._compiler_or_400().json_object)
                return self._json_object
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise OpenAIError("response_format of type json_schema needs json_schema.schema",
                                  param="response_format.json_schema", code="missing_field")
            return await asyncio.to_thread(self._compiler_or_400().json_schema, fmt.json_schema.schema_)
        except GrammarError as exc:
            raise OpenAIError(str(exc), param=exc.param, code="invalid_value") from None

    async def schema(self, schema: dict[str, Any], param: str) -> Grammar:
        """A grammar for JSON under ``schema`` (a tool call's), a 400 naming ``param`` if it cannot be built."""
        try:
            return await asyncio.to_thread(self._compiler_or_400().json_schema, schema, param)
        except GrammarError as exc:
            raise OpenAIError(str(exc), param=param, code="invalid_value") from None

    def _compiler_or_400(self) -> GrammarCompiler:
        if self._compiler is None:
            backend = getattr(self._tokenizer, "backend_json", None)
            if backend is None or not self._vocab_size:
                raise OpenAIError("this model has no tokenizer, so no response_format", param="response_format",
                                  code="no_tokenizer")
            self._compiler = GrammarCompiler(backend(), self._vocab_size, self._tokenizer.eos_token_ids)
        return self._compiler
