"""Tiny random Hugging Face checkpoints of each supported family, for tests.

``make_checkpoint(tmp_path, "llama")`` writes a 2-layer model with transformers'
``save_pretrained`` and returns its directory; ``load_hf_model`` loads the same
directory back with transformers as the reference implementation.
"""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")

_COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    bos_token_id=1,
    eos_token_id=2,
)


def hf_config(family: str) -> transformers.PretrainedConfig:
    """The transformers config for a tiny model of ``family``."""
    if family == "llama":
        # Tied embeddings and Llama 3.1 rope scaling, the two Llama specifics worth covering.
        rope = {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        }
        return transformers.LlamaConfig(**_COMMON, tie_word_embeddings=True, rope_parameters=rope)
    if family == "mistral":
        return transformers.MistralConfig(**_COMMON, sliding_window=None)
    if family == "qwen2":
        return transformers.Qwen2Config(**_COMMON)
    if family == "qwen3":
        return transformers.Qwen3Config(**_COMMON)
    raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES}")


def make_checkpoint(tmp_path: Path, family: str, max_shard_size: str | None = None, seed: int = 0) -> Path:
    """Write a tiny random ``family`` checkpoint under ``tmp_path`` and return its directory."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(family), dtype=torch.float32)
    with torch.no_grad():
        # Random norm weights and biases, so a wrongly loaded norm or bias shows in the logits.
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.1)
    out = Path(tmp_path) / f"tiny-{family}"
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out, **kwargs)
    return out


def load_hf_model(path: Path) -> transformers.PreTrainedModel:
    """The transformers reference model for a checkpoint directory, in float32 eval mode."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    return model.eval()
