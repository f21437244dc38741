"""Our engine vs transformers ``generate`` on the embedded tiny model, on this machine.

Workloads (greedy, ``ignore_eos``: every request produces exactly its ``max_tokens``):
- concurrency 1: one prompt, ``--max-tokens`` tokens;
- concurrency 16, uniform: 16 prompts of 24-64 tokens, all ``--max-tokens`` long;
  transformers gets one left-padded batch with identical output lengths -- the best case
  for static batching and so the honest worst case for us;
- concurrency 16, mixed: what a server sees -- prompts of 16..512 tokens, ``max_tokens``
  of 16..256 (fixed seed). Compared with (a) transformers ``generate`` one request at a
  time (a generate-per-request server) and (b) static batching: all 16 prompts left-padded,
  ``max(max_tokens)`` steps, counting only each request's own ``max_tokens`` as output;
- TTFT of a 512-token prompt (one output token).

Each measurement is the median of ``--repeats`` interleaved rounds (ours, then theirs)
after a warm-up, because this machine is shared and noisy. Every round gets fresh prompts
(the same lengths, new tokens): prefix caching stays on, as a server runs, but finds nothing
to reuse, so each system computes every prompt. The report prints the prefix-cache hits the
engine had during the run, which is 0. Prints a markdown table and says which concurrency-16
comparisons reach the issue's 3x goal.

    python bench/engine_throughput.py [--max-tokens 128] [--threads N] [--repeats 3] [--device cpu]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.model.embedded import ensure_embedded_model

GOAL = 3.0  # issue 2: at concurrency 16, at least 3x transformers' tokens/s


def make_prompts(n: int, vocab: int, seed: int = 0, lo: int = 24, hi: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def mixed_workload(n: int, vocab: int, seed: int = 16) -> tuple[list[list[int]], list[int]]:
    """Prompts of 16..512 tokens and output lengths of 16..256, as a busy server would see."""
    rng = random.Random(seed)
    prompts = make_prompts(n, vocab, seed=seed, lo=16, hi=512)
    return prompts, [rng.randint(16, 256) for _ in range(n)]


def fresh_rounds(workload: str, prompts: list[list[int]], repeats: int, vocab: int) -> list[list[list[int]]]:
    """``prompts`` for the warm-up and each round: the same lengths, new tokens every round (and in
    every workload), so nothing finds what an earlier round left in the prefix cache."""
    rounds = []
    for r in range(repeats + 1):
        rng = random.Random(f"{workload} round {r}")
        rounds.append([[rng.randrange(4, vocab) for _ in p] for p in prompts])
    return rounds


def median_of_interleaved(fns: list[Callable[[int], None]], repeats: int) -> list[float]:
    """Median wall time (s) of each function over ``repeats`` alternating rounds, after a warm-up.
    Each function is called with the round's number (0 is the warm-up) to pick its fresh prompts;
    within a round every function gets the same ones."""
    for fn in fns:
        fn(0)
    times: list[list[float]] = [[] for _ in fns]
    for r in range(1, repeats + 1):
        for i, fn in enumerate(fns):
            t0 = time.perf_counter()
            fn(r)
            times[i].append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def hf_model(path, device: str):
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None
    return model


def hf_generate(model, prompts: list[list[int]], max_tokens: int, device: str) -> None:
    """One ``generate`` call over left-padded ``prompts``, exactly ``max_tokens`` new tokens each."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.inference_mode():
        out = model.generate(
            ids, attention_mask=mask, do_sample=False, max_new_tokens=max_tokens, min_new_tokens=max_tokens, pad_token_id=0
        )
    assert out.shape[1] == width + max_tokens


def ours_generate(engine: LLMEngine, prompts: list[list[int]], max_tokens: list[int]) -> None:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
    outs = engine.generate(prompts, params)
    assert [len(o) for o in outs] == max_tokens


Row = tuple[str, float, float]  # name, pdserve, transformers (both: higher is better)


def throughput_rows(engine, model, args, vocab: int) -> list[Row]:
    n, dev, rows = args.max_tokens, args.device, []
    for conc in (1, 16):
        rounds = fresh_rounds(f"c{conc}", make_prompts(conc, vocab, seed=conc), args.repeats, vocab)
        t_ours, t_hf = median_of_interleaved(
            [lambda r: ours_generate(engine, rounds[r], [n] * conc), lambda r: hf_generate(model, rounds[r], n, dev)],
            args.repeats,
        )
        label = "c1" if conc == 1 else "c16 uniform vs one padded batch, equal lengths (best case for transformers)"
        rows.append((f"{label}: output tok/s", conc * n / t_ours, conc * n / t_hf))
    prompts, lens = mixed_workload(16, vocab)
    rounds = fresh_rounds("c16 mixed", prompts, args.repeats, vocab)
    useful = sum(lens)

    def hf_one_by_one(r: int) -> None:
        for p, m in zip(rounds[r], lens):
            hf_generate(model, [p], m, dev)

    t_ours, t_seq, t_static = median_of_interleaved(
        [lambda r: ours_generate(engine, rounds[r], lens), hf_one_by_one,
         lambda r: hf_generate(model, rounds[r], max(lens), dev)],
        args.repeats,
    )
    rows.append(("c16 mixed vs generate one request at a time: output tok/s", useful / t_ours, useful / t_seq))
    rows.append(("c16 mixed vs static batch (pad to longest, useful tokens only): output tok/s", useful / t_ours, useful / t_static))
    return rows


def ttft_row(engine, model, args, vocab: int) -> Row:
    repeats = args.repeats + 4
    rounds = fresh_rounds("ttft", make_prompts(1, vocab, seed=512, lo=512, hi=512), repeats, vocab)
    t_ours, t_hf = median_of_interleaved(
        [lambda r: ours_generate(engine, rounds[r], [1]), lambda r: hf_generate(model, rounds[r], 1, args.device)],
        repeats,
    )
    # as a speed (1/s) so that the ratio column reads "higher is better" on every row
    return ("TTFT, 512-token prompt: ms (ratio = transformers ms / pdserve ms)", 1 / t_ours, 1 / t_hf)


def print_report(rows: list[Row], args, cache_hits: int) -> None:
    print(f"\nembedded model, {args.device}, torch threads {torch.get_num_threads()}, "
          f"max_tokens {args.max_tokens}, median of {args.repeats} interleaved rounds "
          f"(TTFT: {args.repeats + 4}); fresh prompts every round, prefix caching on: "
          f"{cache_hits} prompt tokens found cached\n")
    print("| workload | pdserve | transformers | pdserve / transformers |")
    print("|---|---:|---:|---:|")
    for name, ours, theirs in rows:
        if name.startswith("TTFT"):
            print(f"| {name} | {1e3 / ours:,.1f} | {1e3 / theirs:,.1f} | {ours / theirs:.2f}x |")
        else:
            print(f"| {name} | {ours:,.1f} | {theirs:,.1f} | {ours / theirs:.2f}x |")
    c16 = [(name.split(":")[0], ours / theirs) for name, ours, theirs in rows if name.startswith("c16")]
    met = [f"{name} ({r:.2f}x)" for name, r in c16 if r >= GOAL]
    missed = [f"{name} ({r:.2f}x)" for name, r in c16 if r < GOAL]
    print(f"\nGoal {GOAL:.0f}x transformers' tokens/s at concurrency 16:")
    print("  met:     " + ("; ".join(met) or "none"))
    print("  not met: " + ("; ".join(missed) or "none"))


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
    rows = throughput_rows(engine, model, args, vocab)
    rows.append(ttft_row(engine, model, args, vocab))
    print_report(rows, args, engine.stats().prefix_cache_hits)


if __name__ == "__main__":
    main()
