"""Load a Hugging Face checkpoint directory into a ``CausalLM``.

The model is built on the ``meta`` device (no memory, no init cost), materialised empty on
the target device, then every parameter is filled from ``*.safetensors`` exactly once.
Checkpoint tensors that we keep packed go through the parameter's ``weight_loader``.

A tensor-parallel rank (``tp`` of size N) reads only its slice of each sharded tensor
(``safe_open(...).get_slice``), so a rank's peak is its share of the weights, not all of them.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from common.model.config import ModelConfig, ModelFilesError, ModelLoadError
from common.model.llama import CausalLM
from common.model.tensor_parallel import TPShard, check_split, checkpoint_slice

# Buffers some older checkpoints saved; we recompute them.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight")


def load_model(
    path: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
    tp: TPShard | None = None,
) -> tuple[CausalLM, ModelConfig]:
    """Build the model in ``path`` (rank ``tp``'s part of it) on ``device`` in ``dtype``, ready for
    inference; TensorParallelError when its heads do not split over ``tp.size`` ranks."""
    directory = Path(path)
    config = ModelConfig.from_dir(directory)
    tp = tp or TPShard()
    check_split(config, tp.size)
    device = torch.device(device)
    files = checkpoint_files(directory)
    with torch.device("meta"):
        model = CausalLM(config, tp)
    model.to(dtype).materialize(device)
    _load_weights(model, files)
    model.eval()
    model.requires_grad_(False)
    return model, config


def checkpoint_files(directory: Path) -> list[Path]:
    """The safetensors files of a single-file or sharded checkpoint."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelFilesError(f"missing checkpoint shard(s) {', '.join(missing)} in {directory}")
        return files
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelFilesError(f"missing model.safetensors (no *.safetensors files) in model directory {directory}")
    return files


def _read_tensors(files: list[Path], config: ModelConfig, tp: TPShard) -> Iterator[tuple[str, torch.Tensor]]:
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                part = checkpoint_slice(name, config, tp)
                if part is None:
                    yield name, f.get_tensor(name)
                else:
                    dim, start, stop = part
                    yield name, f.get_slice(name)[(slice(None),) * dim + (slice(start, stop),)]


def _load_weights(model: CausalLM, files: list[Path]) -> None:
    params = dict(model.named_parameters())
    shards_needed = {name: 0 for name in params}
    for packed, _ in model.packed_modules_mapping.values():
        for name in params:
            if f".{packed}." in name:
                shards_needed[name] += 1
    loaded: dict[str, int] = {}
    unexpected: list[str] = []
    for name, tensor in _read_tensors(files, model.config, model.tp):
        if name.endswith(_IGNORED_SUFFIXES):
            continue
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue  # tied: the embedding is the head
        target, shard = _target(model, name)
        param = params.get(target)
        if param is None:
            unexpected.append(name)
            continue
        with torch.no_grad():
            if shard is None and tensor.shape[0] < param.shape[0] and name.endswith(_VOCAB_TENSORS):
                _check_shape(name, param[: tensor.shape[0]], tensor)  # the last rank's vocab rows, padded
                param[: tensor.shape[0]].copy_(tensor)
                param[tensor.shape[0] :].zero_()
            elif shard is None:
                _check_shape(name, param, tensor)
                param.copy_(tensor)
            else:
                param.weight_loader(param, tensor, shard)
        loaded[target] = loaded.get(target, 0) + 1
    missing = [n for n, shards in shards_needed.items() if loaded.get(n, 0) < max(shards, 1)]
    if missing or unexpected:
        raise ModelLoadError(
            f"checkpoint does not match the {model.config.architecture} model: "
            f"missing weights {missing or 'none'}; unexpected weights {unexpected or 'none'}"
        )


def _target(model: CausalLM, name: str) -> tuple[str, str | int | None]:
    for part, (packed, shard) in model.packed_modules_mapping.items():
        if f".{part}." in name:
            return name.replace(f".{part}.", f".{packed}."), shard
    return name, None


def _check_shape(name: str, param: torch.Tensor, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ModelLoadError(f"weight {name} has shape {tuple(tensor.shape)}, the model expects {tuple(param.shape)}")
