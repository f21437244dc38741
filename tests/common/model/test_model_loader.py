"""The loader reads sharded checkpoints and refuses bad directories with errors a person can act on."""

from __future__ import annotations

import json

import pytest
import torch

from common.model.config import ModelConfig, ModelFilesError, ModelLoadError, UnsupportedModelError
from common.model.loader import load_model
from helpers.hf_checkpoints import make_checkpoint


def test_sharded_checkpoint_loads_same_weights(tmp_path):
    single = make_checkpoint(tmp_path / "single", "qwen2")
    sharded = make_checkpoint(tmp_path / "sharded", "qwen2", max_shard_size="50KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    a, _ = load_model(single)
    b, _ = load_model(sharded)
    for (name, pa), (_, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert torch.equal(pa, pb), name
    assert not any(p.requires_grad for p in b.parameters())


def test_tied_embeddings_share_one_tensor(tmp_path):
    model, config = load_model(make_checkpoint(tmp_path, "llama"))
    assert config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_config_reads_eos_from_generation_config(tmp_path):
    path = make_checkpoint(tmp_path, "mistral")
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7], "bos_token_id": 1}))
    config = ModelConfig.from_dir(path)
    assert config.eos_token_ids == [2, 7]
    assert config.kv_layout(16, "bfloat16").layer_shape(3) == (2, 3, 16, 2, 16)


def test_unsupported_architecture_names_found_and_supported(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel") as info:
        load_model(path)
    assert "LlamaForCausalLM" in str(info.value) and "Qwen3ForCausalLM" in str(info.value)
    assert isinstance(info.value, ModelLoadError)


def test_missing_files_are_named(tmp_path):
    path = make_checkpoint(tmp_path, "llama")
    (path / "model.safetensors").unlink()
    with pytest.raises(ModelFilesError, match="model.safetensors") as info:
        load_model(path)
    assert str(path) in str(info.value)
    (path / "config.json").unlink()
    with pytest.raises(ModelFilesError, match="config.json"):
        ModelConfig.from_dir(path)
    with pytest.raises(ModelFilesError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nowhere")


def test_missing_shard_is_named(tmp_path):
    path = make_checkpoint(tmp_path, "qwen3", max_shard_size="50KB")
    shard = sorted(path.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(ModelFilesError, match=shard.name):
        load_model(path)


def test_weights_of_another_shape_or_name_are_reported(tmp_path):
    path = make_checkpoint(tmp_path, "mistral")
    raw = json.loads((path / "config.json").read_text())
    raw["architectures"] = ["Qwen3ForCausalLM"]  # expects q_norm/k_norm weights the checkpoint lacks
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match="q_norm"):
        load_model(path)
