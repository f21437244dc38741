"""What a GGUF checkpoint holds, read and checked before anything is converted.

``read_gguf(path)`` parses the file's header, metadata and tensor table with ggml-org's
``gguf`` package (a memory map: no tensor data is read) and turns them into the Hugging Face
facts pdserve loads: a ``config.json`` dict and, per checkpoint tensor, the GGUF tensor it
comes from. Every problem a file can have is found here, as one ``GGUFError`` naming the file
and the field: wrong magic, a truncated file, an architecture or tensor type pdserve does not
implement, a tensor whose shape does not match the config. The conversion
(common/model/gguf_convert.py) then only dequantizes. No torch here: the command line checks
a ``--model FILE.gguf`` with this before any process starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# GGUF's architecture name -> the Hugging Face architecture pdserve implements for it.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
# The tensor types dequantized at load (gguf's numpy kernels); each is tested.
SUPPORTED_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                   "Q6_K")
# llama.cpp's converter permutes the rows of Q and K for these (rotary halves interleaved).
PERMUTED_QK = ("llama",)

# GGUF tensor name (per layer: "blk.N." + key) -> Hugging Face name (per layer: "model.layers.N." + value).
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1's scaled rotary frequencies, stored as per-pair divisors


class GGUFError(ValueError):
    """A GGUF file pdserve cannot serve; the message names the file and the field."""


@dataclass(frozen=True)
class GGUFTensor:
    """One checkpoint tensor: its Hugging Face name and where it is in the file."""

    hf_name: str
    gguf_name: str
    type_name: str
    shape: tuple[int, ...]  # row-major (PyTorch order)
    unpermute_heads: int = 0  # > 0: undo llama.cpp's Q/K row permutation over this many heads


@dataclass(frozen=True)
class GGUFModel:
    path: Path
    architecture: str  # GGUF's name, e.g. "llama"
    config: dict[str, Any]  # config.json
    metadata: dict[str, Any]  # every key-value field, arrays as lists
    tensors: tuple[GGUFTensor, ...]

    def field(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)


def open_reader(path: Path) -> Any:
    """gguf's reader over ``path`` (memory-mapped); GGUFError when it is not a readable GGUF."""
    from gguf import GGUFReader  # numpy: loaded only for a GGUF

    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read: {exc.strerror}") from None
    if magic != b"GGUF":
        raise GGUFError(f"{path}: magic: not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return GGUFReader(str(path), "r")
    except (ValueError, IndexError, KeyError, OSError, TypeError) as exc:
        raise GGUFError(f"{path}: header: unreadable, the file is truncated or damaged ({exc})") from None


def read_gguf(path: str | Path) -> GGUFModel:
    """The model in ``path``, checked (GGUFError otherwise); reads no tensor data."""
    path = Path(path)
    reader = open_reader(path)
    metadata = {key: _contents(path, key, field) for key, field in reader.fields.items()}
    arch = metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(f"{path}: general.architecture: {arch!r} is not supported "
                        f"(pdserve serves {', '.join(sorted(ARCHITECTURES))})")
    _check_data(path, reader)
    present = {t.name: t for t in reader.tensors}
    config = _config(path, arch, metadata, present)
    return GGUFModel(path, arch, config, metadata, tuple(_tensors(path, arch, config, present)))


def _contents(path: Path, key: str, field: Any) -> Any:
    try:
        return field.contents()
    except (ValueError, IndexError, UnicodeDecodeError) as exc:
        raise GGUFError(f"{path}: {key}: unreadable value ({exc})") from None


def _check_data(path: Path, reader: Any) -> None:
    size = path.stat().st_size
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise GGUFError(f"{path}: tensor {tensor.name}: its data ends at byte {end}, past the end of the "
                            f"file ({size} bytes): the file is truncated")


def _need(path: Path, metadata: dict[str, Any], key: str) -> Any:
    value = metadata.get(key)
    if value is None:
        raise GGUFError(f"{path}: {key}: missing")
    if isinstance(value, list):
        raise GGUFError(f"{path}: {key}: per-layer values are not supported")
    return value


def _config(path: Path, arch: str, metadata: dict[str, Any], tensors: dict[str, Any]) -> dict[str, Any]:
    def need(key: str) -> Any:
        return _need(path, metadata, f"{arch}.{key}")

    heads = int(need("attention.head_count"))
    hidden = int(need("embedding_length"))
    kv_heads = metadata.get(f"{arch}.attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise GGUFError(f"{path}: {arch}.attention.head_count_kv: per-layer values are not supported")
    vocab = metadata.get(f"{arch}.vocab_size") or len(metadata.get("tokenizer.ggml.tokens") or [])
    if not vocab and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[1])
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_act": "silu",
        "num_hidden_layers": int(need("block_count")),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(kv_heads),
        "head_dim": int(metadata.get(f"{arch}.attention.key_length") or hidden // heads),
        "vocab_size": int(vocab),
        "max_position_embeddings": int(metadata.get(f"{arch}.context_length") or 4096),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(metadata.get(f"{arch}.rope.freq_base") or 10000.0),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "torch_dtype": "float32",
    }
    scaling = metadata.get(f"{arch}.rope.scaling.type")
    if scaling == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": float(need("rope.scaling.factor"))}
    elif scaling not in (None, "none"):
        raise GGUFError(f"{path}: {arch}.rope.scaling.type: {scaling!r} is not supported (linear is)")
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        if metadata.get(name) is not None:
            config[key] = int(metadata[name])
    return config


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face layer-tensor name (without the layer prefix) -> its shape under ``config``."""
    h, inter, d = config["hidden_size"], config["intermediate_size"], config["head_dim"]
    q, kv = config["num_attention_heads"] * d, config["num_key_value_heads"] * d
    return {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.q_proj.bias": (q,),
        "self_attn.k_proj.weight": (kv, h), "self_attn.k_proj.bias": (kv,),
        "self_attn.v_proj.weight": (kv, h), "self_attn.v_proj.bias": (kv,),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (inter, h), "mlp.up_proj.weight": (inter, h), "mlp.down_proj.weight": (h, inter),
        "model.embed_tokens.weight": (config["vocab_size"], h), "lm_head.weight": (config["vocab_size"], h),
        "model.norm.weight": (h,),
    }


def _tensors(path: Path, arch: str, config: dict[str, Any], present: dict[str, Any]) -> list[GGUFTensor]:
    expected = _expected_shapes(config)
    layers = config["num_hidden_layers"]
    out: list[GGUFTensor] = []
    for name, tensor in present.items():
        type_name = tensor.tensor_type.name
        if name == ROPE_FREQS:
            config["rope_scaling"] = {"rope_type": "freq_factors", "source": ROPE_FREQS}
        else:
            hf_name, key = _hf_name(path, name, layers)
            shape = tuple(int(n) for n in reversed(list(tensor.shape)))
            if shape != expected[key]:
                raise GGUFError(f"{path}: tensor {name}: shape {shape} does not match the config "
                                f"(expected {expected[key]})")
            heads = 0
            if arch in PERMUTED_QK and key in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
                heads = config["num_attention_heads" if "q_proj" in key else "num_key_value_heads"]
            out.append(GGUFTensor(hf_name, name, type_name, shape, heads))
        if type_name not in SUPPORTED_TYPES:
            raise GGUFError(f"{path}: tensor {name}: type {type_name} is not supported "
                            f"(pdserve dequantizes {', '.join(SUPPORTED_TYPES)})")
    _check_complete(path, config, {t.hf_name for t in out})
    return out


def _check_complete(path: Path, config: dict[str, Any], names: set[str]) -> None:
    needed = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config["tie_word_embeddings"]:
        needed.append("lm_head.weight")
    per_layer = [key for key in _expected_shapes(config) if key.endswith("weight") and not key.startswith(
        ("model.", "lm_head", "self_attn.q_norm", "self_attn.k_norm"))]
    if config["model_type"] == "qwen3":
        per_layer += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
    needed += [f"model.layers.{i}.{key}" for i in range(config["num_hidden_layers"]) for key in per_layer]
    missing = [name for name in needed if name not in names]
    if missing:
        raise GGUFError(f"{path}: tensors: {len(missing)} missing for the config, first {missing[0]}")


def _hf_name(path: Path, name: str, layers: int) -> tuple[str, str]:
    """(Hugging Face name, shape key) of GGUF tensor ``name``; GGUFError for one pdserve has no place for."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name], _GLOBAL_NAMES[name]
    prefix, _, rest = name.partition(".")
    index, _, key = rest.partition(".")
    if prefix == "blk" and index.isdigit() and int(index) < layers and key in _LAYER_NAMES:
        return f"model.layers.{index}.{_LAYER_NAMES[key]}", _LAYER_NAMES[key]
    raise GGUFError(f"{path}: tensor {name}: not a tensor of the {layers}-layer model pdserve implements")
