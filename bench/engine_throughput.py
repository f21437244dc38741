"""Our engine vs transformers ``generate`` on the embedded tiny model, on this machine.

Measures output tokens/s at concurrency 1 and 16 (transformers: one batched ``generate``
of left-padded prompts; both ignore eos and produce ``--max-tokens`` tokens each) and
the time to first token of a 512-token prompt. Prints a markdown table.

    python bench/engine_throughput.py [--max-tokens 128] [--threads N] [--device cpu]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.model.embedded import ensure_embedded_model


def make_prompts(n: int, vocab: int, seed: int = 0, lo: int = 24, hi: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def best_of_interleaved(fns, repeats: int) -> list[float]:
    """Fastest wall time (s) of each function over ``repeats`` alternating rounds, after a warm-up.

    Alternating and keeping the minimum makes the comparison fair on a shared, noisy machine.
    """
    for fn in fns:
        fn()
    best = [float("inf")] * len(fns)
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - t0)
    return best


def hf_model(path, device: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_generate(model, prompts, max_tokens: int, device: str) -> None:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0
        )
    assert out.shape[1] == width + max_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    path = ensure_embedded_model()
    vocab = 2048
    model = hf_model(path, args.device)
    engine = LLMEngine(EngineConfig(model=str(path), device=args.device, max_num_seqs=64))
    n, rows = args.max_tokens, []
    greedy = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    for conc in (1, 16):
        prompts = make_prompts(conc, vocab, seed=conc)
        t_ours, t_hf = best_of_interleaved(
            [lambda: engine.generate(prompts, greedy), lambda: hf_generate(model, prompts, n, args.device)],
            args.repeats,
        )
        rows.append((f"output tokens/s, concurrency {conc}", conc * n / t_ours, conc * n / t_hf))
    long_prompt = make_prompts(1, vocab, seed=512, lo=512, hi=512)
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    t_ours, t_hf = best_of_interleaved(
        [lambda: engine.generate(long_prompt, one), lambda: hf_generate(model, long_prompt, 1, args.device)],
        args.repeats + 2,
    )
    rows.append(("TTFT ms, 512-token prompt (lower is better)", t_ours * 1e3, t_hf * 1e3))

    print(f"\nembedded model, {args.device}, torch threads {torch.get_num_threads()}, max_tokens {n}\n")
    print("| metric | pdserve | transformers | pdserve / transformers |")
    print("|---|---:|---:|---:|")
    for name, a, b in rows:
        print(f"| {name} | {a:,.1f} | {b:,.1f} | {a / b:.2f}x |")


if __name__ == "__main__":
    main()
