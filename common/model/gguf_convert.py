"""A GGUF checkpoint turned, once, into a Hugging Face directory pdserve loads like any other.

``ensure_converted(file, cache_root)`` returns ``cache_root/<stem>-<key>/``, writing it first
when it is not there: ``config.json``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` and ``model.safetensors``. Every tensor is dequantized with gguf's
numpy kernels to float32 (F16 stays float16: lossless), Q and K rows of a Llama file are put
back in Hugging Face's order (llama.cpp's converter interleaves the rotary halves), and the
loader then casts to the engine's dtype (float32 on CPU, bfloat16 on GPU). The key covers the
file's path, size and modification time and this converter's version, so a changed file is
converted again. The directory is written under a temporary name and renamed into place, with
a lock held, so two daemons started together convert once and never read half a directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from common.model.config import write_json
from common.model.gguf_file import ROPE_FREQS, GGUFError, GGUFModel, GGUFTensor, open_reader, read_gguf
from common.model.gguf_tokenizer import build_tokenizer, stop_token_ids

logger = logging.getLogger(__name__)

CONVERTER_VERSION = 1  # bump when the output of a conversion changes
SOURCE_FILE = "pdserve-source.json"  # written last: a directory without it is not complete


def cache_key(path: Path) -> str:
    stat = path.stat()
    text = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{CONVERTER_VERSION}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def ensure_converted(file: str | Path, cache_root: str | Path) -> Path:
    """The converted directory of GGUF ``file`` under ``cache_root`` (GGUFError for a bad file)."""
    file = Path(file)
    target = Path(cache_root) / f"{file.stem}-{cache_key(file)}"
    if (target / SOURCE_FILE).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(target.parent / f".{target.name}.lock"):
        if (target / SOURCE_FILE).is_file():  # another process converted it while we waited
            return target
        tmp = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex}"
        try:
            logger.info("converting %s into %s (once)", file, target)
            convert(file, tmp)
            shutil.rmtree(target, ignore_errors=True)  # an incomplete directory from a killed run
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def convert(file: str | Path, directory: str | Path) -> None:
    """Write the Hugging Face directory of GGUF ``file`` into ``directory`` (created)."""
    from safetensors.numpy import save_file

    model = read_gguf(file)
    tokenizer, tokenizer_config = build_tokenizer(model)
    directory = Path(directory)
    directory.mkdir(parents=True)
    reader = open_reader(model.path)
    by_name = {t.name: t for t in reader.tensors}
    config = dict(model.config)
    if ROPE_FREQS in by_name:
        factors = dequantize_tensor(model.path, by_name[ROPE_FREQS])
        config["rope_scaling"] = {"rope_type": "freq_factors", "freq_factors": [float(f) for f in factors.ravel()]}
    tensors = {t.hf_name: _tensor(model, by_name[t.gguf_name], t) for t in model.tensors}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save(str(directory / "tokenizer.json"))
    write_json(directory / "tokenizer_config.json", tokenizer_config)
    write_json(directory / "config.json", config)
    generation = {"eos_token_id": stop_token_ids(model)}
    if "bos_token_id" in config:
        generation["bos_token_id"] = config["bos_token_id"]
    write_json(directory / "generation_config.json", generation)
    write_json(directory / SOURCE_FILE, {"gguf": str(model.path.resolve()), "converter_version": CONVERTER_VERSION,
                                          "name": model.path.stem})


def _tensor(model: GGUFModel, raw: Any, tensor: GGUFTensor) -> np.ndarray:
    values = dequantize_tensor(model.path, raw).reshape(tensor.shape)
    if tensor.unpermute_heads:
        values = unpermute_rows(values, tensor.unpermute_heads)
    return np.ascontiguousarray(values)


def dequantize_tensor(path: Path, raw: Any) -> np.ndarray:
    """The values of gguf reader tensor ``raw`` (of file ``path``): float32, or float16 for F16."""
    from gguf.quants import dequantize

    data = np.asarray(raw.data)
    if raw.tensor_type.name == "F16":
        return data.view(np.float16)
    try:
        return dequantize(data, raw.tensor_type).astype(np.float32, copy=False)
    except (ValueError, NotImplementedError) as exc:
        raise GGUFError(f"{path}: tensor {raw.name}: cannot dequantize {raw.tensor_type.name} ({exc})") from None


def unpermute_rows(weights: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of Q/K rows: per head, its two rotary halves were interleaved."""
    half = weights.shape[0] // heads // 2
    return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)

