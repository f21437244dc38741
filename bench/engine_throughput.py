"""Our engine vs transformers ``generate`` on the same weights (fp32), on this machine.

``--model`` picks them: ``embedded`` (the default: the tiny random model), ``default``
(SmolLM2-135M-Instruct, fetched and converted once, as a node with no ``--model`` serves it),
a Hugging Face directory or a ``.gguf``; both systems load the one directory it resolves to.

Workloads (greedy, ``ignore_eos``: every request produces exactly its ``max_tokens``;
transformers gets ``min_new_tokens`` = ``max_new_tokens`` and no EOS id):
- ``c1``, concurrency 1: one prompt of ``--prompt-tokens``, ``--max-tokens`` tokens;
- ``c16``, concurrency 16, uniform: 16 prompts of ``--prompt-tokens``, all ``--max-tokens`` long;
  transformers gets them as one batch with identical output lengths -- the best case
  for static batching and so the honest worst case for us;
- ``mixed``, concurrency 16: what a server sees -- prompts of 16..512 tokens, ``max_tokens``
  of 16..256 (fixed seed). Compared with (a) transformers ``generate`` one request at a
  time (a generate-per-request server) and (b) static batching: all 16 prompts left-padded,
  ``max(max_tokens)`` steps, counting only each request's own ``max_tokens`` as output;
- ``ttft``: TTFT of a 512-token prompt (one output token).

Each measurement is the median of ``--repeats`` interleaved rounds (ours, then theirs)
after a warm-up, because this machine is shared and noisy. Every round gets fresh prompts
(the same lengths, new random token ids) and our engine runs with prefix caching off, so each
system computes every prompt (the report prints the engine's prefix-cache hits: 0). Prints a
markdown table with each ratio beside its goal (issue 29: at least 1.0x at concurrency 1, 3x
against the static batch at 16).

    python bench/engine_throughput.py [--model embedded|default|DIR|FILE.gguf] [--max-tokens 128]
        [--prompt-tokens 64] [--workloads c1,c16,mixed,ttft] [--threads N] [--repeats 3] [--device cpu]
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

from common.defaults import DEFAULT_CACHE_DIR, EMBEDDED_MODEL_SPEC
from common.engine.config import EngineConfig
from common.engine.llm_engine import LLMEngine
from common.engine.sampling_params import SamplingParams
from common.model.sources import resolve_model

WORKLOADS = ("c1", "c16", "mixed", "ttft")


def model_source(value: str) -> tuple[Path, str]:
    """``--model``: (the directory both systems load, the name to print); ``default`` is the model a
    node serves without ``--model``."""
    return resolve_model(None if value == "default" else value, DEFAULT_CACHE_DIR)


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


def goal(name: str) -> float | None:
    """Issue 29's goal for a row's ratio (issue 2's 3x for the mixed static batch), None where it sets none."""
    if name.startswith("c1:"):
        return 1.0
    if name.startswith(("c16 uniform", "c16 mixed vs static")):
        return 3.0
    return None


def throughput_rows(engine, model, args, vocab: int) -> list[Row]:
    n, dev, rows = args.max_tokens, args.device, []
    for conc in (1, 16):
        if f"c{conc}" not in args.workloads:
            continue
        prompts = make_prompts(conc, vocab, seed=conc, lo=args.prompt_tokens, hi=args.prompt_tokens)
        rounds = fresh_rounds(f"c{conc}", prompts, args.repeats, vocab)
        t_ours, t_hf = median_of_interleaved(
            [lambda r: ours_generate(engine, rounds[r], [n] * conc), lambda r: hf_generate(model, rounds[r], n, dev)],
            args.repeats,
        )
        label = "c1" if conc == 1 else "c16 uniform vs one static batch, equal lengths (best case for transformers)"
        rows.append((f"{label}: output tok/s", conc * n / t_ours, conc * n / t_hf))
    if "mixed" not in args.workloads:
        return rows
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


def print_report(rows: list[Row], args, label: str, cache_hits: int) -> None:
    print(f"\n{label}, fp32, {args.device}, torch threads {torch.get_num_threads()}, "
          f"prompts of {args.prompt_tokens} tokens (c1, c16), max_tokens {args.max_tokens}, median of "
          f"{args.repeats} interleaved rounds (TTFT: {args.repeats + 4}); fresh prompts every round, "
          f"prefix caching off: {cache_hits} prompt tokens found cached\n")
    print("| workload | pdserve | transformers | pdserve / transformers | goal |")
    print("|---|---:|---:|---:|---|")
    for name, ours, theirs in rows:
        shown = (1e3 / ours, 1e3 / theirs) if name.startswith("TTFT") else (ours, theirs)
        target = goal(name)
        verdict = "" if target is None else f"≥ {target:.1f}x: {'met' if ours / theirs >= target else 'missed'}"
        print(f"| {name} | {shown[0]:,.1f} | {shown[1]:,.1f} | {ours / theirs:.2f}x | {verdict} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=EMBEDDED_MODEL_SPEC,
                    help="embedded (the tiny random model, default), default (SmolLM2-135M-Instruct), "
                         "a Hugging Face directory or a .gguf")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length at concurrency 1 and 16")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help="a comma-separated subset of " + ",".join(WORKLOADS))
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    args.workloads = args.workloads.split(",")
    if unknown := set(args.workloads) - set(WORKLOADS):
        ap.error(f"unknown workloads {sorted(unknown)}; choose from {','.join(WORKLOADS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    path, name = model_source(args.model)
    model = hf_model(path, args.device)
    vocab = model.config.vocab_size  # prompts are random ids below it
    engine = LLMEngine(EngineConfig(model=str(path), device=args.device, max_num_seqs=64, dtype="float32",
                                    enable_prefix_caching=False))
    rows = throughput_rows(engine, model, args, vocab)
    if "ttft" in args.workloads:
        rows.append(ttft_row(engine, model, args, vocab))
    print_report(rows, args, name, engine.stats().prefix_cache_hits)


if __name__ == "__main__":
    main()
