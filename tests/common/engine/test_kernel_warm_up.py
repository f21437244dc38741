"""The engine's kernel choice at start: fused ops on or off, and a Triton warm-up that fails.

Triton's kernels run here in its CPU interpreter. A failure is either injected (a backend whose
forward raises, as a kernel that cannot compile does) or real: a subprocess without the
interpreter, where Triton finds no driver for CPU tensors. ``auto`` picks Triton only for CUDA,
so the tests that need that choice on CPU make ``choose_kernels`` see a CUDA device; what it
decides from the device is tested in tests/common/model/test_kernel_choice.py.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from common.engine import llm_engine
from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.model.attention import PLAIN, TritonStartError, choose_kernels

pytest.importorskip("triton")
REPO = Path(__file__).resolve().parents[3]
PROMPTS = [[5] * 3, [7] * 20]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def as_on_cuda(backend: str, fused_ops: str, device: torch.device, batch_invariant: bool = False):
    """``choose_kernels`` as it decides on a CUDA machine with triton installed."""
    return choose_kernels(backend, fused_ops, torch.device("cuda"), batch_invariant)


def generate(checkpoint, **options) -> tuple[list[list[int]], LLMEngine]:
    engine = LLMEngine(EngineConfig(model=str(checkpoint), device="cpu", num_kv_blocks=16, **options))
    return engine.generate(PROMPTS, GREEDY), engine


@pytest.fixture
def fused_calls(monkeypatch):
    """How often each fused kernel ran (a spy around the real kernels)."""
    from common.model import fused_ops

    calls = {"rms_norm": 0, "apply_rotary": 0, "silu_and_mul": 0}
    for name in calls:
        real = getattr(fused_ops, name)

        def spy(*args, _real=real, _name=name):
            calls[_name] += 1
            return _real(*args)

        monkeypatch.setattr(fused_ops, name, spy)
    return calls


@pytest.fixture
def triton_attention_fails(monkeypatch):
    from common.model.attn_backends import triton_paged

    def fail(self, *args, **kwargs):
        raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")

    monkeypatch.setattr(triton_paged.TritonBackend, "forward", fail)


def test_fused_ops_on_run_the_fused_kernels_and_give_the_same_tokens(checkpoint_dir, fused_calls):
    path = checkpoint_dir("qwen3")  # q/k norms: every fused op has a caller
    plain, off = generate(path, fused_ops="off")
    assert not off.runner.model.use_fused_ops and sum(fused_calls.values()) == 0
    fused, on = generate(path, fused_ops="on")
    assert on.runner.model.use_fused_ops and on.runner.kernels.required == ("--fused-ops on",)
    assert all(n > 0 for n in fused_calls.values()), fused_calls
    assert fused == plain


def test_auto_choice_whose_warm_up_fails_falls_back_to_sdpa_and_plain_ops(
        checkpoint_dir, monkeypatch, caplog, triton_attention_fails, fused_calls):
    want, _ = generate(checkpoint_dir("llama"))
    monkeypatch.setattr(llm_engine, "choose_kernels", as_on_cuda)
    with caplog.at_level(logging.WARNING, logger="common.engine.model_runner"):
        got, engine = generate(checkpoint_dir("llama"))
    assert engine.runner.kernels == PLAIN
    assert engine.runner.attn_backend.name == "sdpa" and not engine.runner.model.use_fused_ops
    assert got == want
    warning = caplog.text
    assert "Failed to find C compiler" in warning and "--attention-backend sdpa --fused-ops off" in warning
    assert "C compiler and the Python headers" in warning
    calls_at_warm_up = sum(fused_calls.values())
    engine.generate(PROMPTS, GREEDY)  # fused kernels ran in the failed warm-up only, never after it
    assert sum(fused_calls.values()) == calls_at_warm_up


def test_named_triton_whose_warm_up_fails_stops_the_start(checkpoint_dir, triton_attention_fails):
    with pytest.raises(TritonStartError, match="--attention-backend triton asked for Triton.*C compiler"):
        generate(checkpoint_dir("llama"), attention_backend="triton")


def run_python(code: str) -> dict:
    """``code`` in a fresh interpreter without Triton's CPU interpreter; the JSON it prints last."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


ENGINE = """
import json, sys, torch
from common.engine import llm_engine
from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.model.attention import TritonStartError, choose_kernels

def generate(**options):
    engine = LLMEngine(EngineConfig(model={path!r}, device="cpu", num_kv_blocks=16, **options))
    return engine.generate({prompts!r}, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)), engine
"""


def test_without_fused_ops_the_model_never_imports_them(checkpoint_dir):
    code = ENGINE.format(path=str(checkpoint_dir("llama")), prompts=PROMPTS) + """
out = {}
for fused in ("off", "auto"):  # auto: off on CPU
    tokens, engine = generate(fused_ops=fused)
    out[fused] = [engine.runner.model.use_fused_ops, len(tokens[1])]
ours = ("common.model.fused_ops", "common.model.attn_backends.triton_paged")
out["imported"] = sorted(m for m in ours if m in sys.modules)
print(json.dumps(out))
"""
    out = run_python(code)
    # not `triton` itself: torch imports it on its own (torch._dynamo, when a model is built on meta)
    assert out == {"off": [False, 6], "auto": [False, 6], "imported": []}


def test_a_real_triton_failure_at_warm_up_falls_back_or_stops(checkpoint_dir):
    """Without the interpreter Triton cannot launch on CPU tensors: a genuine runtime failure."""
    code = ENGINE.format(path=str(checkpoint_dir("llama")), prompts=PROMPTS) + """
want, _ = generate()
llm_engine.choose_kernels = lambda b, f, d, i: choose_kernels(b, f, torch.device("cuda"), i)  # as on a GPU
got, engine = generate()
try:
    generate(fused_ops="on")
    named = "started"
except TritonStartError as exc:
    named = str(exc)
print(json.dumps({"same": got == want, "kernels": [engine.runner.attn_backend.name,
                  engine.runner.model.use_fused_ops], "named": named}))
"""
    out = run_python(code)
    assert out["same"] and out["kernels"] == ["sdpa", False]
    assert out["named"].startswith("--fused-ops on asked for Triton, but its kernels failed at warm-up")
