"""Shared fixtures: tiny random checkpoints and their transformers greedy references."""

from __future__ import annotations

import pytest
import torch

from helpers.hf_checkpoints import load_hf_model, make_checkpoint

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """``checkpoint_dir(family)`` -> a tiny random checkpoint, written once per session."""
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = make_checkpoint(tmp_path_factory.mktemp(family), family)
        return made[family]

    return get


@pytest.fixture(scope="session")
def hf_greedy():
    """``hf_greedy(path, prompts, n)``: transformers' greedy tokens for each prompt alone."""
    return _hf_greedy


def _hf_greedy(path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = load_hf_model(path)
    model.generation_config.eos_token_id = None
    outs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        gen = model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
        )
        outs.append(gen[0, len(prompt) :].tolist())
    return outs
