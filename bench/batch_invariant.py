"""What ``--batch-invariant`` costs: output tokens/s and TTFT with and without it, one engine each.

    python bench/batch_invariant.py [--model embedded|default|DIR|FILE.gguf] [--concurrency 1,16]
        [--requests 32] [--prompt-tokens 64] [--max-tokens 32] [--repeats 3] [--threads N] [--device cpu]

For each concurrency, ``--requests`` greedy requests (``ignore_eos``: each makes exactly
``--max-tokens`` tokens) of ``--prompt-tokens`` random tokens go through the engine with at most
that many in flight (a new one joins as one finishes). Nothing is reused: prefix caching is off
and every round has fresh random prompts. Output tokens/s = all output tokens / the round's
wall time; TTFT = the median, over requests, of the time from ``add_request`` to the step that
returned its first token; CPU ms per output token = this process's CPU time over the round /
its output tokens (steadier than wall time on a shared machine). Each figure is the median of
``--repeats`` rounds, the two modes interleaved (the machine is shared and noisy). ``--model default`` is SmolLM2-135M-Instruct as a
node with no ``--model`` serves it (``common.model.sources.resolve_model``).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.defaults import DEFAULT_CACHE_DIR, EMBEDDED_MODEL_SPEC  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.llm_engine import LLMEngine  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402
from common.model.sources import resolve_model  # noqa: E402


def run_round(engine: LLMEngine, concurrency: int, requests: int, prompt_tokens: int, max_tokens: int,
              seed: int) -> tuple[float, float, float]:
    """(output tokens/s, median TTFT in s, this process's CPU s per output token) of one round."""
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    pending = [[rng.randrange(4, vocab) for _ in range(prompt_tokens)] for _ in range(requests)]
    sent: dict[str, float] = {}
    in_flight: set[str] = set()
    ttft: list[float] = []
    tokens = 0
    start, cpu = time.perf_counter(), time.process_time()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            rid = f"r{seed}-{len(sent)}"
            engine.add_request(rid, pending.pop(), params)
            sent[rid] = time.perf_counter()
            in_flight.add(rid)
        for out in engine.step():
            if out.new_token_ids and out.num_output_tokens == len(out.new_token_ids):  # its first token(s)
                ttft.append(time.perf_counter() - sent[out.request_id])
            tokens += len(out.new_token_ids)
            if out.finished:
                in_flight.discard(out.request_id)
    return tokens / (time.perf_counter() - start), statistics.median(ttft), (time.process_time() - cpu) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=EMBEDDED_MODEL_SPEC, help="embedded, default, a directory or a .gguf")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir, name = resolve_model(None if args.model == "default" else args.model, DEFAULT_CACHE_DIR)
    engines = {mode: LLMEngine(EngineConfig(model=str(model_dir), device=args.device, batch_invariant=mode,
                                            enable_prefix_caching=False, max_num_seqs=64))
               for mode in (False, True)}
    head = engines[True].runner.model.lm_head
    linears = (f"oneDNN on packed weights, rows padded to a multiple of {head.tile}" if head.packed is not None
               else f"batched matmuls on tiles of {head.tile} rows")
    print(f"model {name}, {args.device}, {torch.get_num_threads()} threads, {args.requests} requests of "
          f"{args.prompt_tokens} prompt tokens and {args.max_tokens} output tokens per round, "
          f"median of {args.repeats}; invariant linears: {linears}\n")
    print("| concurrency | mode | output tok/s | TTFT (ms) | CPU ms / output token | cost: tok/s, CPU |")
    print("|---:|---|---:|---:|---:|---:|")
    for concurrency in map(int, args.concurrency.split(",")):
        for engine in engines.values():  # warm-up
            run_round(engine, concurrency, min(args.requests, concurrency), args.prompt_tokens, 4, seed=999)
        figures: dict[bool, list[tuple[float, float, float]]] = {False: [], True: []}
        for r in range(args.repeats):
            for mode, engine in engines.items():
                figures[mode].append(run_round(engine, concurrency, args.requests, args.prompt_tokens,
                                               args.max_tokens, seed=r))
        base_tps, _, base_cpu = (statistics.median(f[i] for f in figures[False]) for i in range(3))
        for mode in (False, True):
            tps, ttft, cpu = (statistics.median(f[i] for f in figures[mode]) for i in range(3))
            cost = "" if not mode else f"{(1 - tps / base_tps) * 100:.0f} %, {(cpu / base_cpu - 1) * 100:.0f} %"
            print(f"| {concurrency} | {'batch-invariant' if mode else 'default'} | {tps:.1f} | {ttft * 1e3:.1f} | "
                  f"{cpu * 1e3:.2f} | {cost} |")


if __name__ == "__main__":
    main()
