"""GPU benches on a machine without CUDA: they say so and exit 0 (CI runs on CPU)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_bench_without_cuda_says_so_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # hides a GPU where there is one
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_engine.py")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is not available" in proc.stdout and "nothing measured" in proc.stdout


def test_ttft_bench_gpu_shape_without_cuda_says_so_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "ttft_breakdown.py"), "--shape", "llama3.1-8b"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "CUDA is not available" in proc.stdout
