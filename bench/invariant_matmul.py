"""The batch-invariant Triton matmul (``common/model/invariant_matmul.py``) against cuBLAS, on a GPU.

    python bench/invariant_matmul.py

For the linears of the Qwen2.5-0.5B and Llama-3.1-8B shapes (bf16, random weights), at 1, 16,
256 and 2,000 rows: the time of ``F.linear`` (cuBLAS, which picks its kernel by the shape) and
of the invariant matmul with its small (64 x 64) and large (128 x 128) tiles; and whether the
large tiles give every row the small tiles' bits (the start-up check that lets a long chunk use
them). Prints a markdown table. Without CUDA it says so and exits 0.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {  # (in, out) of each distinct linear
    "0.5B": [(896, 896), (896, 128), (896, 4864), (4864, 896), (896, 151936)],
    "8B": [(4096, 4096), (4096, 1024), (4096, 14336), (14336, 4096), (4096, 128256)],
}
ROWS = (1, 16, 256, 2000)


def cuda_ms(fn, reps: int = 20) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    if not torch.cuda.is_available():
        print("CUDA is not available: bench/invariant_matmul.py times GPU matmuls; nothing measured.")
        return 0
    from common.model.invariant_matmul import invariant_linear, large_tiles_agree

    print(f"GPU: {torch.cuda.get_device_name()}; ms per call (CUDA events, 20 calls)\n")
    print("| shape | in x out | rows | cuBLAS | invariant, small tiles | invariant, large tiles | large = small |")
    print("|---|---|---:|---:|---:|---:|---|")
    g = torch.Generator().manual_seed(0)
    total = {"cublas": 0.0, "small": 0.0, "large": 0.0}
    for name, shapes in SHAPES.items():
        for k, n in shapes:
            w = torch.randn(n, k, generator=g).to("cuda", torch.bfloat16)
            agree = large_tiles_agree([w])
            for m in ROWS:
                x = torch.randn(m, k, generator=g).to("cuda", torch.bfloat16)
                t = (cuda_ms(lambda: F.linear(x, w)), cuda_ms(lambda: invariant_linear(x, w, None)),
                     cuda_ms(lambda: invariant_linear(x, w, None, large_from=1)))
                if m == 2000 and name == "8B":
                    for key, value in zip(total, t):
                        total[key] += value
                print(f"| {name} | {k} x {n} | {m} | {t[0]:.3f} | {t[1]:.3f} | {t[2]:.3f} | "
                      f"{'yes' if agree else 'NO'} |")
    print(f"\n8B, 2,000 rows, one of each linear: cuBLAS {total['cublas']:.2f} ms, small tiles {total['small']:.2f}, "
          f"large tiles {total['large']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
