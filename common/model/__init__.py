"""The model side of the engine: config, loader, paged-attention decoder, tokenizer, embedded model.

The names below are the public API the engine and serving layers use.
"""

from __future__ import annotations

from common.model.attention_metadata import AttentionMetadata
from common.model.config import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    ModelFilesError,
    ModelLoadError,
    UnsupportedModelError,
)
from common.model.detokenizer import IncrementalDetokenizer
from common.model.embedded import EMBEDDED_MODEL_NAME, ensure_embedded_model
from common.model.llama import CausalLM
from common.model.loader import load_model
from common.model.tokenizer import ChatTemplateError, Tokenizer

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "AttentionMetadata",
    "CausalLM",
    "ChatTemplateError",
    "EMBEDDED_MODEL_NAME",
    "IncrementalDetokenizer",
    "ModelConfig",
    "ModelFilesError",
    "ModelLoadError",
    "Tokenizer",
    "UnsupportedModelError",
    "ensure_embedded_model",
    "load_model",
]
