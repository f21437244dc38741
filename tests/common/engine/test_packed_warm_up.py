"""What a CPU engine does at start so that its first requests pay no first-call costs: it builds
oneDNN's kernels for its packed linears (float32), so a fresh engine's first requests, prompts and
decode steps of every row count, build none; and its thread runs a forward before the first
request (a thread's first ops start its OpenMP team).

oneDNN keeps one kernel cache per process, so that check runs in a fresh process, reading
oneDNN's own verbose log (a line per kernel built: ``create:cache_miss``).
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from common.engine.async_engine import AsyncLLMEngine
from common.engine.config import EngineConfig

REPO = Path(__file__).resolve().parents[3]
SCRIPT = """
import json, sys, torch
from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams

engine = LLMEngine(EngineConfig(model="embedded", device="cpu", max_num_seqs=8, max_num_batched_tokens=64))
if sys.argv[1] == "on":  # what AsyncLLMEngine does before it serves; "off": the control, without it
    engine.runner.warm_up_kernels()
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


def test_the_engine_thread_runs_a_forward_before_its_first_request():
    engine = AsyncLLMEngine(EngineConfig(model="embedded", device="cpu", num_kv_blocks=16, max_num_seqs=4,
                                         max_num_batched_tokens=32))
    model, threads = engine.engine.runner.model, []
    real = model.forward

    def spy(*args, **kwargs):
        threads.append(threading.current_thread().name)
        return real(*args, **kwargs)

    model.forward = spy
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while "pdserve-engine" not in threads and time.monotonic() < deadline:
            time.sleep(0.01)
        assert "pdserve-engine" in threads and not engine.engine.has_unfinished_requests()
    finally:
        engine.shutdown()
