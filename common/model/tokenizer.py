"""Text <-> token ids for a Hugging Face model directory, and its chat template.

``tokenizer.json`` is run by the ``tokenizers`` library; ``tokenizer_config.json`` adds
what HF keeps outside it (bos/eos tokens, ``add_bos_token``, the chat template, which
may also live in ``chat_template.jinja``). Chat templates render in a sandboxed,
immutable jinja2 environment configured the way transformers configures it.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from common.model.config import ModelFilesError, read_json


class ChatTemplateError(ValueError):
    """The model has no chat template, or the template failed on these messages."""


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as text or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


class Tokenizer:
    """A model's tokenizer: ``encode``, ``decode`` and ``apply_chat_template``."""

    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any], chat_template: str | None,
                 extra_eos_ids: list[int] | None = None) -> None:
        self._tok = tokenizer
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.chat_template = chat_template
        self._extra_eos_ids = list(extra_eos_ids or [])

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load ``tokenizer.json`` and ``tokenizer_config.json`` from a model directory."""
        directory = Path(path)
        if not (directory / "tokenizer.json").is_file():
            raise ModelFilesError(f"missing tokenizer.json in model directory {directory}")
        config: dict[str, Any] = {}
        if (directory / "tokenizer_config.json").is_file():
            config = read_json(directory, "tokenizer_config.json")
        template = config.get("chat_template")
        if isinstance(template, list):  # several named templates: use the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if template is None and (directory / "chat_template.jinja").is_file():
            template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
        eos_ids: list[int] = []
        if (directory / "generation_config.json").is_file():
            eos = read_json(directory, "generation_config.json").get("eos_token_id")
            eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(HFTokenizer.from_file(str(directory / "tokenizer.json")), config, template, eos_ids)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tok.token_to_id(self.bos_token)

    @property
    def eos_token_ids(self) -> list[int]:
        """The eos token of tokenizer_config.json, then generation_config.json's stop ids."""
        ids = [] if self.eos_token is None else [self._tok.token_to_id(self.eos_token)]
        return list(dict.fromkeys(i for i in ids + self._extra_eos_ids if i is not None))

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with special tokens, a bos is prepended when the model wants one."""
        if len(text) > 4096:  # encode_batch releases the GIL (encode does not): a long prompt
            # tokenized in a worker thread then leaves the server's event loop running
            ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        else:
            ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def backend_json(self) -> str:
        """The ``tokenizers`` tokenizer serialized (what a grammar engine reads the vocabulary from)."""
        return self._tok.to_str()

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        return [self._tok.id_to_token(i) for i in ids]

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use the completions API instead")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            return env.from_string(self.chat_template)
        except jinja2.exceptions.TemplateError as e:
            raise ChatTemplateError(f"the model's chat template does not compile: {e}") from e

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` with the model's chat template; raises ChatTemplateError."""
        template = self._compiled_template
        try:
            return template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **kwargs,
            )
        except (jinja2.exceptions.TemplateError, TypeError, KeyError, ValueError) as e:
            raise ChatTemplateError(f"cannot render the chat template: {e}") from e
