"""The embedded model is generated deterministically and atomically, and runs like a real checkpoint."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import transformers

from common.model.config import ModelConfig
from common.model.embedded import EMBEDDED_MODEL_DIRNAME, EMBEDDED_MODEL_NAME, ensure_embedded_model
from common.model.loader import load_model
from common.model.tokenizer import Tokenizer
from helpers.paged_cache import PagedCache


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return ensure_embedded_model(tmp_path_factory.mktemp("cache"))


def test_generation_is_byte_identical_and_reused(model_dir, tmp_path):
    other = ensure_embedded_model(tmp_path)
    assert other.name == model_dir.name == EMBEDDED_MODEL_DIRNAME
    names = sorted(p.name for p in model_dir.iterdir())
    assert names == sorted(p.name for p in other.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                     "tokenizer_config.json"]
    for name in names:
        assert (model_dir / name).read_bytes() == (other / name).read_bytes(), name
    mtime = (other / "model.safetensors").stat().st_mtime_ns
    assert ensure_embedded_model(tmp_path) == other
    assert (other / "model.safetensors").stat().st_mtime_ns == mtime


def test_racing_creators_leave_one_complete_copy(tmp_path):
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: ensure_embedded_model(tmp_path), range(2)))
    assert paths[0] == paths[1]
    assert [p.name for p in tmp_path.iterdir()] == [EMBEDDED_MODEL_DIRNAME]  # no temp dirs left
    assert ModelConfig.from_dir(paths[0]).num_layers == 4


def test_config_is_the_documented_tiny_llama(model_dir):
    config = ModelConfig.from_dir(model_dir)
    assert (config.architecture, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.intermediate_size, config.vocab_size) == ("LlamaForCausalLM", 4, 256, 4, 2, 704, 2048)
    assert config.eos_token_ids == [1, 3] and config.bos_token_id == 0
    assert not config.tie_word_embeddings
    assert EMBEDDED_MODEL_NAME == "pdserve-tiny"
    assert json.loads((model_dir / "tokenizer_config.json").read_text())["eos_token"] == "</s>"


def test_logits_match_transformers(model_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ours, _ = load_model(model_dir)
    tok = Tokenizer.from_dir(model_dir)
    ids = tok.encode("The for statement is used to iterate over the elements of a sequence.")
    cache = PagedCache(ours, num_blocks=16, block_size=8)
    seq = cache.new_seq(ids)
    cache.step([(seq, len(ids) - 3)])
    for _ in range(3):
        cache.step([(seq, 1)])
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    err = ((torch.stack(seq.outputs) - ref).abs().max() / ref.abs().max()).item()
    assert err <= 1e-4
