"""Tiny random GGUF checkpoints, written with gguf's own writer as llama.cpp's converter would.

``write_gguf(path, "qwen2", "Q8_0")`` writes a 2-layer model whose 2-D weights are quantized to
the given type (norms and biases stay F32, as llama.cpp keeps them); Llama files get their Q/K
rows permuted the way the converter permutes them. The vocabulary is the embedded model's
byte-level BPE (tokens, merges, special tokens), so the file's tokenizer is a real one.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np

from common.model.embedded import ensure_embedded_model

SHAPE = dict(hidden=64, inter=128, layers=2, heads=4, kv_heads=2, head_dim=16, ctx=512)
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's permutation of Q/K rows (the inverse of what pdserve undoes)."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def embedded_vocab() -> tuple[list[str], list[int], list[str]]:
    """(tokens, token types, merges) of the embedded model's tokenizer; its special tokens are control (3)."""
    data = json.loads((ensure_embedded_model() / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = {t["content"] for t in data["added_tokens"] if t.get("special")}
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return tokens, [3 if t in special else 1 for t in tokens], merges


def write_gguf(path: Path, arch: str, qtype: str, seed: int = 0, pre: str = "default",
               tensor_hook=None) -> Path:
    """Write a tiny random ``arch`` ("llama" or "qwen2") GGUF with 2-D weights in ``qtype``; returns ``path``.

    ``tensor_hook(name, array) -> (name, array, qtype)`` may change a tensor before it is written
    (tests of bad files)."""
    s = SHAPE
    tokens, types, merges = embedded_vocab()
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(s["layers"])
    writer.add_context_length(s["ctx"])
    writer.add_embedding_length(s["hidden"])
    writer.add_feed_forward_length(s["inter"])
    writer.add_head_count(s["heads"])
    writer.add_head_count_kv(s["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)
    q, kv = s["heads"] * s["head_dim"], s["kv_heads"] * s["head_dim"]
    h, inter, vocab = s["hidden"], s["inter"], len(tokens)

    def normal(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)

    tensors: dict[str, np.ndarray] = {"token_embd.weight": normal(vocab, h),
                                      "output_norm.weight": rng.uniform(0.5, 1.5, h).astype(np.float32),
                                      "output.weight": normal(vocab, h)}
    for i in range(s["layers"]):
        p = f"blk.{i}."
        tensors |= {p + "attn_norm.weight": rng.uniform(0.5, 1.5, h).astype(np.float32),
                    p + "ffn_norm.weight": rng.uniform(0.5, 1.5, h).astype(np.float32),
                    p + "attn_q.weight": normal(q, h), p + "attn_k.weight": normal(kv, h),
                    p + "attn_v.weight": normal(kv, h), p + "attn_output.weight": normal(h, q),
                    p + "ffn_gate.weight": normal(inter, h), p + "ffn_up.weight": normal(inter, h),
                    p + "ffn_down.weight": normal(h, inter)}
        if arch == "qwen2":
            tensors |= {p + "attn_q.bias": normal(q), p + "attn_k.bias": normal(kv), p + "attn_v.bias": normal(kv)}
        if arch == "llama":
            tensors[p + "attn_q.weight"] = llama_cpp_permute(tensors[p + "attn_q.weight"], s["heads"])
            tensors[p + "attn_k.weight"] = llama_cpp_permute(tensors[p + "attn_k.weight"], s["kv_heads"])
    for name, array in tensors.items():
        kind = qtype if array.ndim == 2 else "F32"
        if tensor_hook is not None:
            name, array, kind = tensor_hook(name, array, kind)
        add_tensor(writer, name, array, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def add_tensor(writer: gguf.GGUFWriter, name: str, array: np.ndarray, kind: str) -> None:
    qtype = gguf.GGMLQuantizationType[kind]
    if kind in ("F32", "F16"):
        writer.add_tensor(name, array.astype(np.float16 if kind == "F16" else np.float32))
    else:
        data = array if array.dtype == np.uint8 else gguf.quants.quantize(array, qtype)
        writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
