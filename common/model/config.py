"""The model facts pdserve needs, read from a Hugging Face model directory.

``ModelConfig.from_dir`` reads ``config.json`` (and ``generation_config.json`` for the
stop tokens) and normalises the per-family differences: Qwen2 always has a q/k/v bias,
Qwen3 normalises q and k per head, Llama 3 may scale its rotary frequencies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch: the command line reads this module's errors without it
    from common.kv_layout import KVLayout

SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)


class ModelLoadError(Exception):
    """A model directory cannot be turned into a runnable model."""


class UnsupportedModelError(ModelLoadError):
    """The checkpoint's architecture is not one pdserve implements."""


class ModelFilesError(ModelLoadError):
    """Files the loader needs are missing or unreadable."""


def read_json(directory: Path, name: str) -> dict[str, Any]:
    """Read ``directory/name`` as JSON, raising ModelFilesError when it is absent or bad."""
    path = directory / name
    if not path.is_file():
        raise ModelFilesError(f"missing {name} in model directory {directory}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ModelFilesError(f"cannot read {path}: {e}") from e


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as a model directory's JSON files are written (sorted keys, indented)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass
class ModelConfig:
    architecture: str
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: list[int]
    bos_token_id: int | None

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read a Hugging Face model directory's config; raises ModelLoadError subclasses."""
        directory = Path(path)
        if not directory.is_dir():
            raise ModelFilesError(f"model directory {directory} does not exist")
        raw = read_json(directory, "config.json")
        architecture = _architecture(raw, directory)
        act = raw.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"unsupported hidden_act {act!r} in {directory / 'config.json'}; pdserve supports silu")
        generation = {}
        if (directory / "generation_config.json").is_file():
            generation = read_json(directory, "generation_config.json")
        return cls.from_hf_dict(raw, architecture, generation)

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], architecture: str, generation: dict[str, Any]) -> ModelConfig:
        hidden = int(raw["hidden_size"])
        num_heads = int(raw["num_attention_heads"])
        eos = _as_id_list(generation.get("eos_token_id")) or _as_id_list(raw.get("eos_token_id"))
        bos = generation.get("bos_token_id", raw.get("bos_token_id"))
        return cls(
            architecture=architecture,
            model_type=str(raw.get("model_type", "")),
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or num_heads),
            head_dim=int(raw.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(_rope_theta(raw)),
            rope_scaling=_rope_scaling(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            # Qwen2 checkpoints carry a q/k/v bias without saying so in config.json.
            attention_bias=architecture == "Qwen2ForCausalLM" or bool(raw.get("attention_bias", False)),
            qk_norm=architecture == "Qwen3ForCausalLM",
            eos_token_ids=eos,
            bos_token_id=None if bos is None else int(bos),
        )

    def kv_layout(self, block_size: int, dtype: str) -> KVLayout:
        """The paged KV cache layout this model needs at ``block_size`` and ``dtype``."""
        from common.kv_layout import KVLayout

        return KVLayout(
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            block_size=block_size,
            dtype=dtype,
        )


def _architecture(raw: dict[str, Any], directory: Path) -> str:
    found = raw.get("architectures") or []
    for name in found:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    shown = ", ".join(found) if found else "none listed"
    raise UnsupportedModelError(
        f"unsupported architecture in {directory / 'config.json'}: found {shown}; "
        f"pdserve supports {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _rope_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    # transformers 5 writes "rope_parameters" (theta and scaling together); 4.x wrote
    # "rope_theta" and "rope_scaling" separately. Accept both.
    params = raw.get("rope_parameters")
    return dict(params) if isinstance(params, dict) else {}


def _rope_theta(raw: dict[str, Any]) -> float:
    return raw.get("rope_theta") or _rope_parameters(raw).get("rope_theta") or 10000.0


def _rope_scaling(raw: dict[str, Any]) -> dict[str, Any] | None:
    scaling = raw.get("rope_scaling") or _rope_parameters(raw)
    if not scaling:
        return None
    scaling = {k: v for k, v in scaling.items() if k != "rope_theta"}
    kind = scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return None
    return scaling
