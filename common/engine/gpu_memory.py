"""How much GPU memory the KV cache gets: ``--gpu-memory-utilization`` (vLLM's meaning).

The fraction is of the device's *total* memory and covers everything this process holds
(weights, activations, the KV cache), so two daemons on one GPU each take a share that
fits beside the other's (``pdserve up`` gives each :func:`split_share` of the default).
The KV cache gets what is left of the share after the weights (measured) and a reserve
for one step's activations (estimated). A share that cannot be had fails at start with
the numbers. Pure functions: the engine passes in what it measured.

Only this process's bytes (its allocator's, ``torch.cuda.memory_reserved``) are taken from its
share; the device's free memory only checks that the share can still be had. So two daemons
starting at once on one GPU, with shares that add up to at most the default 0.9, each get the
same KV cache whatever the other holds at the moment (tests/common/engine/test_graph_memory_share.py
runs every order). What lies outside any allocator (each process's CUDA context, ~0.5 GiB) is
not in the share: it is why the shares should leave some of the GPU over.
"""

from __future__ import annotations

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
GiB = 1 << 30


class GpuMemoryError(ValueError):
    """The KV cache does not fit in this process's share; the message has the numbers."""


def activation_reserve(hidden_size: int, intermediate_size: int, vocab_size: int, max_num_batched_tokens: int,
                       max_num_seqs: int, dtype_bytes: int) -> int:
    """Bytes one engine step may need beside weights and KV: the widest per-token tensors
    (residual, q/k/v, gate/up/down) for the step's token budget, plus float32 logits for
    every sequence it samples. An estimate on the generous side, not a profile."""
    per_token = (6 * hidden_size + 3 * intermediate_size) * dtype_bytes
    return max_num_batched_tokens * per_token + max_num_seqs * vocab_size * 4


def kv_cache_budget(total: int, free: int, used_by_process: int, utilization: float, reserve: int) -> int:
    """Bytes for the KV cache; raises :class:`GpuMemoryError` when nothing is left or the
    share is larger than what the GPU has free (another process holds the rest).

    ``total``/``free``: the device's (``torch.cuda.mem_get_info``); ``used_by_process``:
    what this process already holds (the weights, ``torch.cuda.memory_reserved``)."""
    if not 0 < utilization <= 1:
        raise GpuMemoryError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")
    share = utilization * total
    budget = int(share - used_by_process - reserve)
    numbers = (f"--gpu-memory-utilization {utilization:g} gives this process {share / GiB:.2f} GiB of the "
               f"GPU's {total / GiB:.2f} GiB; the weights take {used_by_process / GiB:.2f} GiB and one "
               f"step's activations ~{reserve / GiB:.2f} GiB")
    if budget <= 0:
        raise GpuMemoryError(f"{numbers}: nothing is left for the KV cache. Raise --gpu-memory-utilization, "
                             "use a smaller model or lower --max-num-batched-tokens")
    if budget + reserve > free:
        raise GpuMemoryError(f"{numbers}, so the KV cache would need {budget / GiB:.2f} GiB more, but only "
                             f"{free / GiB:.2f} GiB is free (another process holds "
                             f"{(total - free - used_by_process) / GiB:.2f} GiB). Lower "
                             "--gpu-memory-utilization here or in the other process")
    return budget


def split_share(num_processes: int, utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION) -> float:
    """Each process's ``--gpu-memory-utilization`` when ``num_processes`` share one GPU."""
    if num_processes < 1:
        raise ValueError("num_processes must be >= 1")
    return int(utilization / num_processes * 100) / 100
