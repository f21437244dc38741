"""Sampler cost per step: the batched sampler on random logits, by batch size and setting.

Prints a markdown table of the median milliseconds per call (one call = one engine step's
sampling, including the device->host copy of the ids and of the logprobs). Runs on CPU,
and on CUDA too when one is present.

    python bench/sampler.py [--vocab 32000] [--repeats 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.sampler import Sampler, SampleRow  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402

SETTINGS = {
    "greedy": dict(temperature=0),
    "temperature": dict(temperature=0.8),
    "top-k 50 + top-p 0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "seeded top-p 0.9": dict(temperature=0.8, top_p=0.9, seed=1),
    "greedy + 5 logprobs": dict(temperature=0, logprobs=5),
}


def time_call(sampler: Sampler, logits: torch.Tensor, rows: list[SampleRow], repeats: int) -> float:
    sampler(logits, rows)  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sampler(logits, rows)  # ends in .tolist(): synchronous on every device
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)  # the CPU engine runs with few threads; many fight on a shared machine
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    batches = (1, 16, 64)
    print(f"Sampler ms per step, vocab {args.vocab}, median of {args.repeats}\n")
    print("| device | setting | " + " | ".join(f"batch {b}" for b in batches) + " |")
    print("|---|---|" + "---:|" * len(batches))
    for device in devices:
        sampler = Sampler(device)
        for name, kw in SETTINGS.items():
            cells = []
            for b in batches:
                logits = torch.randn(b, args.vocab, device=device)
                rows = [SampleRow(SamplingParams(**kw), 100 + i) for i in range(b)]
                cells.append(f"{time_call(sampler, logits, rows, args.repeats):.2f}")
            print(f"| {device.type} | {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
