"""The embedded default model: a tiny Llama that pdserve generates on first use.

No model hub is reachable, so the default model is made locally and deterministically:
seeded weights (std 0.02, norms 1) and a byte-level BPE tokenizer trained on the Python
documentation that ships with Python (``pydoc_data.topics``). The result is a normal
Hugging Face directory, loaded by the same loader as any real checkpoint. Generation
writes a temporary directory and renames it into place, so two processes racing to
create it both end up with one complete copy.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from common.defaults import EMBEDDED_MODEL_NAME  # noqa: F401  (re-exported: the name served for this model)
from common.model.config import write_json

EMBEDDED_MODEL_DIRNAME = "pdserve-tiny-llama-v1"  # bump the version when the recipe changes
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
BOS, EOS, IM_START, IM_END = range(4)  # ids follow SPECIAL_TOKENS (the trainer adds them first)
SEED = 20240601

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 704,
    "vocab_size": 2048,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-5,
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "initializer_range": 0.02,
    "bos_token_id": BOS,
    "eos_token_id": EOS,
    "torch_dtype": "float32",
}

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "pdserve" / "models"


def ensure_embedded_model(cache_dir: str | Path | None = None) -> Path:
    """The embedded model's directory under ``cache_dir``, generated first if it is not there."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / EMBEDDED_MODEL_DIRNAME
    if (target / "config.json").is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{EMBEDDED_MODEL_DIRNAME}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
    try:
        write_embedded_model(tmp)
        os.rename(tmp, target)
    except OSError:
        # Another process renamed its copy into place first: keep theirs.
        if not (target / "config.json").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_embedded_model(directory: Path) -> None:
    """Write the whole model directory (weights, configs, tokenizer) into ``directory``."""
    directory.mkdir(parents=True)
    write_json(directory / "config.json", CONFIG)
    write_json(directory / "generation_config.json", {"bos_token_id": BOS, "eos_token_id": [EOS, IM_END]})
    save_file(_weights(), str(directory / "model.safetensors"), metadata={"format": "pt"})
    _train_tokenizer().save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "add_bos_token": True,
        "add_eos_token": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    })



def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    h, inter, vocab = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"]
    q = CONFIG["num_attention_heads"] * CONFIG["head_dim"]
    kv = CONFIG["num_key_value_heads"] * CONFIG["head_dim"]

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * CONFIG["initializer_range"]

    weights = {"model.embed_tokens.weight": normal(vocab, h)}
    for i in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": normal(q, h),
            p + "self_attn.k_proj.weight": normal(kv, h),
            p + "self_attn.v_proj.weight": normal(kv, h),
            p + "self_attn.o_proj.weight": normal(h, q),
            p + "mlp.gate_proj.weight": normal(inter, h),
            p + "mlp.up_proj.weight": normal(inter, h),
            p + "mlp.down_proj.weight": normal(h, inter),
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
        }
    weights["model.norm.weight"] = torch.ones(h)
    weights["lm_head.weight"] = normal(vocab, h)
    return weights


def _train_tokenizer() -> HFTokenizer:
    from pydoc_data.topics import topics  # ships with CPython: the same text everywhere

    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=CONFIG["vocab_size"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
    )
    texts = [topics[key] for key in sorted(topics)]
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer
