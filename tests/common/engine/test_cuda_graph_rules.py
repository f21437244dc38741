"""The decode forward a CUDA graph captures keeps the graph rules: no host syncs, no host memory.

``CudaGraphRunner`` captures exactly ``model(ids, positions, kv_caches, meta)`` over the inputs
``DecodeBuffers.inputs(bucket)`` gives after ``fill_padding(bucket)``; the attention plan is built
inside that call. This runs the same call, bucket by bucket, with the backend that supports
graphs (Triton, interpreted on CPU) and with and without the fused ops, under
``helpers.graph_rules``; the metadata's host ``seq_lens`` is frozen at capture, so reading it is
a violation too. The checker's own tests show it catches each rule broken in a small function,
and inside the model's forward.
"""

from __future__ import annotations

import os

import pytest
import torch

from common.engine.cuda_graph import DecodeBuffers, graph_batch_sizes
from common.model.attention import KernelChoice, use_kernels
from common.model.loader import load_model
from helpers.graph_rules import GraphRules

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("CPU-interpreter tests; with CUDA, test_cuda_graph_gpu captures real graphs, which a sync breaks",
                allow_module_level=True)

BLOCK_SIZE, NUM_BLOCKS, MAX_BATCH, WIDTH = 4, 12, 4, 3


def decode_setup(path, fused: bool = False):
    """The model on the Triton backend (and the fused ops, or not), KV caches with a scratch block,
    and the graphs' input buffers."""
    model, _ = load_model(path)
    use_kernels(model, KernelChoice("triton", fused), torch.device("cpu"))
    layout = model.config.kv_layout(BLOCK_SIZE, str(model.lm_head.weight.dtype).removeprefix("torch."))
    caches = [torch.zeros(layout.layer_shape(NUM_BLOCKS + 1), dtype=layout.torch_dtype)
              for _ in range(layout.num_layers)]
    buffers = DecodeBuffers(MAX_BATCH, WIDTH, BLOCK_SIZE, NUM_BLOCKS, torch.device("cpu"))
    return model, caches, buffers


def device_memory(model, caches, buffers) -> list[torch.Tensor]:
    """What lives on the device before capture: weights, caches, the graphs' input buffers."""
    return [*model.parameters(), *model.buffers(), *caches, buffers.device_buf, buffers.query_start_loc]


def captured_violations(model, caches, buffers, bucket: int, host_plan: bool = False) -> list[str]:
    """What ``CudaGraphRunner`` captures for ``bucket``, run under the graph rules (with
    ``host_plan``, without the metadata's device tensors, as an eager step has it)."""
    buffers.fill_padding(bucket)
    ids, positions, meta = buffers.inputs(bucket)
    if host_plan:
        meta.query_start_loc = meta.seq_lens_tensor = None
    rules = GraphRules(device_memory(model, caches, buffers))
    meta.seq_lens = rules.frozen(meta.seq_lens, "AttentionMetadata.seq_lens")
    out = []
    violations = rules.run(lambda: out.append(model(ids, positions, caches, meta)))
    assert out[0].shape == (bucket, model.config.hidden_size)
    return violations


@pytest.mark.parametrize("fused", [False, True], ids=["torch_ops", "fused_ops"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_captured_decode_forward_keeps_the_graph_rules(checkpoint_dir, family, fused):
    model, caches, buffers = decode_setup(checkpoint_dir(family), fused)
    for bucket in reversed(graph_batch_sizes(MAX_BATCH)):  # as capture() goes
        assert captured_violations(model, caches, buffers, bucket) == []


def test_checker_finds_a_sync_inside_the_model_forward(checkpoint_dir):
    """A backend whose plan reads a value back: the checker names it, and where."""
    model, caches, buffers = decode_setup(checkpoint_dir("qwen3"))
    triton_plan = model.attn_backend.plan

    def syncing_plan(meta, device):
        if meta.seq_lens_tensor.max().item() > 0:
            return triton_plan(meta, device)
        raise AssertionError("unreachable")

    model.attn_backend.plan = syncing_plan
    violations = captured_violations(model, caches, buffers, 2)
    assert len(violations) == 1
    assert "reads a value back on the host" in violations[0] and "in syncing_plan" in violations[0]


def test_checker_finds_a_plan_built_from_host_lists(checkpoint_dir):
    """Without the buffers' device copies of the offsets and lengths, the plan copies the host's in."""
    model, caches, buffers = decode_setup(checkpoint_dir("qwen3"))
    violations = captured_violations(model, caches, buffers, 2, host_plan=True)
    assert len(violations) == 2 and all("in build_plan" in v for v in violations)
    assert "reads AttentionMetadata.seq_lens" in violations[0] and "host data" in violations[1]


HOST_LIST = [3, 1, 2]
BROKEN = {
    "item": (lambda x, h, seq_lens: x.sum().item(), "reads a value back"),
    "branch on a value": (lambda x, h, seq_lens: x * 2 if x.max() > 0 else x, "reads a value back"),
    "tolist": (lambda x, h, seq_lens: x.tolist(), "Tensor.tolist()"),
    "cpu": (lambda x, h, seq_lens: x.cpu(), "Tensor.cpu()"),
    "nonzero": (lambda x, h, seq_lens: x.nonzero(), "aten::nonzero"),
    "boolean mask": (lambda x, h, seq_lens: x[x > 0], "boolean mask"),
    "tensor from a list": (lambda x, h, seq_lens: x + torch.tensor(HOST_LIST), "host data"),
    "host tensor moved": (lambda x, h, seq_lens: h.to(x.device).contiguous(), "Tensor.to reads host memory"),
    "host tensor read": (lambda x, h, seq_lens: x + h, "aten::add reads host memory"),
    "frozen host list": (lambda x, h, seq_lens: x[: max(seq_lens)], "reads seq_lens"),
}


@pytest.mark.parametrize("case", BROKEN)
def test_checker_fails_a_function_that_breaks_a_rule(case):
    fn, message = BROKEN[case]
    x, h = torch.arange(3.0) - 1, torch.ones(3)
    rules = GraphRules([x])
    seq_lens = rules.frozen(HOST_LIST, "seq_lens")
    violations = rules.run(lambda: fn(x, h, seq_lens))
    assert violations and message in violations[0], violations
    assert "test_cuda_graph_rules.py" in violations[0]  # it says where


def test_checker_passes_a_function_that_keeps_them():
    x = torch.arange(3.0)
    rules = GraphRules([x])
    seq_lens = rules.frozen(HOST_LIST, "seq_lens")
    n = len(seq_lens)  # the bucket size is fixed per graph: reading it is fine
    assert rules.run(lambda: torch.where(x > 0, x * 2, 0.0)[:n].contiguous() + torch.arange(3)) == []
