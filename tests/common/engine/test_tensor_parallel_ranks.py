"""Tensor parallelism across real processes: an engine (and a ``pdserve serve`` node) at
``--tensor-parallel-size 2`` gives the tokens of size 1, and leaves no process behind when it
stops or when a worker rank dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.engine.tp_group import RankLostError
from helpers.cluster import Proc, all_ready, start
from helpers.procs import children, gone
from helpers.waiting import wait_until

ROOT = Path(__file__).resolve().parents[3]
PROMPTS = [[1, 5, 9, 200, 33, 7], [4, 8, 15, 16, 23, 42, 99, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110]]


def _generate(path: str | None, size: int, device: str = "cpu", dtype: str = "auto") -> tuple[dict, dict]:
    """Two greedy requests (with their logprobs) and one seeded n=3 request, whose choices fork
    from a half-full prompt block (a block copy every rank makes), run together."""
    engine = LLMEngine(EngineConfig(model=path, device=device, dtype=dtype, tensor_parallel_size=size,
                                    num_kv_blocks=32, block_size=8))
    try:
        for rid, prompt in zip("ab", PROMPTS):
            engine.add_request(rid, prompt, SamplingParams(max_tokens=12, temperature=0, logprobs=0))
        engine.add_request("c", PROMPTS[0], SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=8))
        tokens, logprobs = {}, {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                key = (out.request_id, out.index)
                tokens.setdefault(key, []).extend(out.new_token_ids)
                if out.new_logprobs is not None:
                    logprobs.setdefault(key, []).extend(lp[t] for lp, t in zip(out.new_logprobs, out.new_token_ids))
        return tokens, logprobs
    finally:
        engine.runner.close()


@pytest.mark.parametrize("family", ["embedded", "qwen2"])
def test_two_ranks_give_the_tokens_of_one(checkpoint_dir, family):
    # block_size 8: the longer prompt spans blocks; qwen2: GQA (4 heads, 2 KV heads) with q/k/v bias
    path = None if family == "embedded" else str(checkpoint_dir(family))
    tokens_1, logprobs_1 = _generate(path, 1)
    tokens_2, logprobs_2 = _generate(path, 2)
    assert len(tokens_1) == 5 and tokens_2 == tokens_1
    assert logprobs_2.keys() == logprobs_1.keys() == {("a", 0), ("b", 0)}
    for key, values in logprobs_1.items():
        assert logprobs_2[key] == pytest.approx(values, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL tensor parallelism needs two CUDA devices")
def test_two_gpu_ranks_over_nccl_give_the_tokens_of_one():
    """Ranks on cuda:0 and cuda:1: the step broadcast over gloo, the model's all-reduces and the
    logits' all-gather over NCCL. float32 for exact greedy parity; bf16 must at least run whole."""
    tokens_1, logprobs_1 = _generate(None, 1, "cuda", "float32")
    tokens_2, logprobs_2 = _generate(None, 2, "cuda", "float32")
    assert len(tokens_1) == 5 and tokens_2 == tokens_1
    for key, values in logprobs_1.items():
        assert logprobs_2[key] == pytest.approx(values, abs=1e-3)
    tokens_bf16, _ = _generate(None, 2, "cuda", "bfloat16")
    assert {k: len(v) for k, v in tokens_bf16.items()} == {k: len(v) for k, v in tokens_1.items()}


def test_a_dead_worker_fails_the_next_step_and_no_worker_is_left():
    engine = LLMEngine(EngineConfig(device="cpu", tensor_parallel_size=2, num_kv_blocks=16))
    leader = engine.runner.leader
    try:
        worker = leader.procs[0]
        worker.kill()
        wait_until(lambda: leader.lost is not None, "rank 0 notices its worker died", timeout=10)
        assert f"rank 1 (pid {worker.pid}) exited" in leader.lost
        engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=2))
        with pytest.raises(RankLostError, match="rank 1"):
            engine.step()
    finally:
        engine.runner.close()
    assert all(p.poll() is not None for p in leader.procs)


@pytest.fixture(scope="module")
def nodes(tmp_path_factory) -> dict[str, Proc]:
    """Three ``pdserve serve`` nodes, started together: size 1, size 2, and a size 2 whose worker dies."""
    tmp = tmp_path_factory.mktemp("tp-nodes")
    procs = {"tp1": start("both", tmp, name="tp1", wait=False)}
    for name in ("tp2", "doomed"):
        procs[name] = start("both", tmp, "--tensor-parallel-size", "2", name=name, wait=False)
    with all_ready(procs):
        yield procs


def _complete(proc: Proc) -> dict:
    body = {"model": "pdserve-tiny", "prompt": "def main(args):", "max_tokens": 16, "temperature": 0, "logprobs": 1}
    reply = httpx.post(proc.url + "/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_ready_and_metrics_say_how_many_ranks_a_node_runs(nodes):
    for name, size in (("tp1", 1), ("tp2", 2)):
        ready = httpx.get(nodes[name].url + "/ready", timeout=10).json()
        assert ready["status"] == "ready" and ready["tensor_parallel_size"] == size
        text = httpx.get(nodes[name].url + "/metrics", timeout=10).text
        assert f'pdserve:tensor_parallel_size{{role="both"}} {float(size)}' in text


def test_serve_with_two_ranks_answers_as_one_and_sigterm_leaves_no_process(nodes):
    one, two = _complete(nodes["tp1"]), _complete(nodes["tp2"])
    assert two["text"] == one["text"]
    assert two["logprobs"]["tokens"] == one["logprobs"]["tokens"]
    assert two["logprobs"]["token_logprobs"] == pytest.approx(one["logprobs"]["token_logprobs"], abs=1e-4)
    node = nodes["tp2"].popen
    workers = children(node.pid)
    assert len(workers) == 1, workers
    node.send_signal(signal.SIGTERM)
    assert node.wait(timeout=30) == 0, nodes["tp2"].log_tail()
    wait_until(lambda: all(gone(w) for w in workers), f"worker {workers} ends with its node", timeout=10)


def test_a_worker_that_dies_ends_its_node_with_no_process_left(nodes):
    proc = nodes["doomed"]
    [worker] = children(proc.popen.pid)
    os.kill(worker, signal.SIGKILL)
    try:
        code = proc.popen.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail("the node did not notice its dead worker:\n" + proc.log_tail())
    assert code == 3, proc.log_tail()
    assert "tensor-parallel rank 1" in proc.log_tail()
    assert children(proc.popen.pid) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_stopped_worker_still_dies_with_rank_0(tmp_path):
    """A worker that cannot read the end of its pipe (stopped here; hung alike) is killed by the
    kernel when rank 0 dies, so no rank outlives its node."""
    code = ("import sys; from common.engine.config import EngineConfig; "
            "from common.engine.llm_engine import LLMEngine; "
            "e = LLMEngine(EngineConfig(device='cpu', tensor_parallel_size=2, num_kv_blocks=16)); "
            "print(e.runner.leader.procs[0].pid, flush=True); sys.stdin.read()")
    rank0 = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             cwd=str(ROOT))
    try:
        worker = int(rank0.stdout.readline())
        os.kill(worker, signal.SIGSTOP)
    finally:
        rank0.kill()
        rank0.wait()
    wait_until(lambda: gone(worker), "the stopped worker is gone", timeout=10)
