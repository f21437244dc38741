"""On CUDA: the graphs' memory reserve ignores another process allocating on the GPU meanwhile."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from common.engine import cuda_graph
from common.engine.config import EngineConfig
from common.model.loader import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
pytest.importorskip("triton")  # graphs are captured with the Triton backend only

OTHER_BYTES = 2 << 30
# Waits for a line, allocates OTHER_BYTES on the GPU, says so, and holds them until stdin closes.
OTHER = f"""
import sys, torch
sys.stdin.readline()
held = torch.empty({OTHER_BYTES}, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("held", flush=True)
sys.stdin.read()
"""


def test_graph_reserve_ignores_another_process_allocating_during_capture(checkpoint_dir, monkeypatch):
    model, model_config = load_model(checkpoint_dir("llama"), device="cuda", dtype=torch.bfloat16)
    config = EngineConfig(device="cuda", max_num_seqs=16)
    layout = model_config.kv_layout(config.block_size, "bfloat16")
    alone = cuda_graph.graph_memory(model, layout, config, model_config.max_position_embeddings)
    assert alone > 0

    other = subprocess.Popen([sys.executable, "-c", OTHER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             text=True)
    try:
        real_fill = cuda_graph.DecodeBuffers.fill_padding
        said = []

        def fill_then_let_the_other_allocate(self, bucket):  # runs inside capture, between its two reads
            if not said:
                other.stdin.write("go\n")
                other.stdin.flush()
                said.append(other.stdout.readline().strip())
            return real_fill(self, bucket)

        monkeypatch.setattr(cuda_graph.DecodeBuffers, "fill_padding", fill_then_let_the_other_allocate)
        free_before, _ = torch.cuda.mem_get_info()
        meanwhile = cuda_graph.graph_memory(model, layout, config, model_config.max_position_embeddings)
        free_after, _ = torch.cuda.mem_get_info()
    finally:
        other.stdin.close()
        other.wait(timeout=60)
    assert said == ["held"] and free_before - free_after >= OTHER_BYTES // 2  # the other did allocate
    assert meanwhile < OTHER_BYTES and abs(meanwhile - alone) <= 64 << 20, (alone, meanwhile)
