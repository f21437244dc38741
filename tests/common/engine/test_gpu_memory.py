"""The GPU memory share rule (--gpu-memory-utilization), as arithmetic: no GPU needed."""

from __future__ import annotations

import pytest

from common.config import NodeConfig, load_config
from common.engine.gpu_memory import (
    GiB,
    GpuMemoryError,
    activation_reserve,
    kv_cache_budget,
    split_share,
)


def test_budget_is_the_share_minus_weights_and_activations():
    # 80 GiB GPU, 0.9 -> 72 GiB; 16 GiB of weights, 2 GiB of activations -> 54 GiB of KV
    assert kv_cache_budget(80 * GiB, 63 * GiB, 16 * GiB, 0.9, 2 * GiB) == 54 * GiB


def test_two_daemons_with_half_shares_both_fit_on_one_gpu():
    total, weights, reserve = 80 * GiB, 16 * GiB, 1 * GiB
    share = split_share(2)
    assert share == 0.45
    first = kv_cache_budget(total, total - weights, weights, share, reserve)
    held_by_first = weights + first
    second = kv_cache_budget(total, total - held_by_first - weights, weights, share, reserve)
    assert first == second > 0
    assert held_by_first + weights + second + 2 * reserve <= total


def test_second_daemon_at_default_share_cannot_fit_and_says_so_with_numbers():
    total, weights = 80 * GiB, 4 * GiB
    first = kv_cache_budget(total, total - weights, weights, 0.9, GiB)  # 67 GiB of KV
    with pytest.raises(GpuMemoryError) as err:  # the second loaded its weights into the 5 GiB left
        kv_cache_budget(total, total - weights - first - weights, weights, 0.9, GiB)
    msg = str(err.value)
    assert "gives this process 72.00 GiB of the GPU's 80.00 GiB" in msg
    assert "only 5.00 GiB is free (another process holds 71.00 GiB)" in msg
    assert "Lower --gpu-memory-utilization" in msg


def test_share_smaller_than_the_weights_leaves_nothing_for_kv():
    with pytest.raises(GpuMemoryError, match="nothing is left for the KV cache. Raise --gpu-memory"):
        kv_cache_budget(24 * GiB, 8 * GiB, 16 * GiB, 0.5, GiB)


@pytest.mark.parametrize("bad", [0.0, -0.1, 1.01])
def test_out_of_range_utilization_refused(bad):
    with pytest.raises(GpuMemoryError, match="must be in"):
        kv_cache_budget(GiB, GiB, 0, bad, 0)


def test_activation_reserve_grows_with_the_step_budget():
    small = activation_reserve(4096, 14336, 128256, 512, 64, 2)
    assert activation_reserve(4096, 14336, 128256, 1024, 64, 2) - small == 512 * (6 * 4096 + 3 * 14336) * 2
    assert small == 512 * (6 * 4096 + 3 * 14336) * 2 + 64 * 128256 * 4


def test_flags_reach_the_engine_config():
    cfg = load_config(NodeConfig, ["--gpu-memory-utilization", "0.45", "--kv-transport", "cuda_ipc"],
                      "pdserve decode", env={})
    assert cfg.kv_transport == "cuda_ipc" and cfg.gpu_memory_utilization == 0.45
    with pytest.raises(SystemExit):
        load_config(NodeConfig, ["--gpu-memory-utilization", "1.5"], "pdserve decode", env={})
    with pytest.raises(SystemExit):
        load_config(NodeConfig, ["--kv-transport", "rdma"], "pdserve decode", env={})
