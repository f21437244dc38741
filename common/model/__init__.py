"""The model side of the engine: config, loader, paged-attention decoder, tokenizer, embedded model,
and where a model comes from (common/model/sources.py: the default model, GGUF files).

The names below are the public API the engine and serving layers use. They load on first use, so
the torch-free modules here (sources, gguf_file, config) can be imported by the command line
without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "SUPPORTED_ARCHITECTURES": "common.model.config",
    "ModelConfig": "common.model.config",
    "ModelFilesError": "common.model.config",
    "ModelLoadError": "common.model.config",
    "UnsupportedModelError": "common.model.config",
    "AttentionMetadata": "common.model.attention_metadata",
    "IncrementalDetokenizer": "common.model.detokenizer",
    "EMBEDDED_MODEL_NAME": "common.model.embedded",
    "ensure_embedded_model": "common.model.embedded",
    "CausalLM": "common.model.llama",
    "load_model": "common.model.loader",
    "ChatTemplateError": "common.model.tokenizer",
    "Tokenizer": "common.model.tokenizer",
    "resolve_model": "common.model.sources",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'common.model' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
