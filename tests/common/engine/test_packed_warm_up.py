"""The engine builds oneDNN's kernels for its packed linears at start (CPU float32): a fresh
engine's first requests, prompts and decode steps of every row count, build none.

oneDNN keeps one kernel cache per process, so the check runs in a fresh process, reading
oneDNN's own verbose log (a line per kernel built: ``create:cache_miss``).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
SCRIPT = """
import json, sys, torch
from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.model_runner import ModelRunner
from common.engine.sampling_params import SamplingParams

if sys.argv[1] == "off":  # the control: the engine as it was before the warm-up
    ModelRunner._warm_up_packed = lambda self, max_num_seqs, max_num_batched_tokens: 0
engine = LLMEngine(EngineConfig(model="embedded", device="cpu", max_num_seqs=8, max_num_batched_tokens=64))
prompts = [[5] * 3, [7] * 20, [9] * 41, [11] * 9]  # prompts alone and beside decodes, 1..8 decode rows
params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, n=2)
print("STEPS", flush=True)
with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON_CREATION):
    out = engine.generate(prompts, params)
print("DONE", json.dumps(engine.runner.warmed_kernels), flush=True)
"""


def kernels_built(warm_up: str) -> tuple[int, int]:
    """(kernels the warm-up ran, kernels oneDNN built during the requests) in a fresh process."""
    done = subprocess.run([sys.executable, "-c", SCRIPT, warm_up], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    after = done.stdout.split("STEPS", 1)[1]
    warmed = int(after.split("DONE", 1)[1])
    return warmed, sum("create:cache_miss" in line for line in after.splitlines())


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN: nothing is packed")
def test_a_fresh_engine_builds_no_kernel_under_its_first_requests():
    warmed, built = kernels_built("on")
    assert warmed > 0 and built == 0
    warmed, built = kernels_built("off")  # the control: the same requests build kernels without it
    assert warmed == 0 and built > 0
