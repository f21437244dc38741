"""What a constrained request costs the batch it decodes in (structured outputs, llguidance).

Reuses nothing between rows but the engine: prefix caching plays no part (every prompt is
computed once, before timing). On the embedded model, 16 sequences decode together with
``ignore_eos``; the table gives the median engine step time while all 16 decode, with none of
them constrained and with one constrained by a JSON schema (the rest unconstrained); then the
sampler alone on such a step's logits, the two cases interleaved call by call (the engine
rows share the machine with whatever else runs; the sampler rows isolate what a grammar adds).

    python bench/structured_output.py [--steps 60] [--batch 16] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.engine.config import EngineConfig  # noqa: E402
from common.engine.llm_engine import LLMEngine  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402
from common.engine.sampler import SampleRow  # noqa: E402
from common.engine.structured_output import GrammarCompiler  # noqa: E402

# unbounded strings: the constrained row keeps decoding for the whole measurement
SCHEMA = {"type": "object", "properties": {"notes": {"type": "array", "items": {"type": "string"}}},
          "required": ["notes"]}


def decode_steps(engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams], steps: int
                 ) -> tuple[list[float], list]:
    """Step times while every sequence decodes (prefill steps are not timed)."""
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", prompt, p)
    times = []
    while engine.has_unfinished_requests() and len(times) < steps:
        running = engine.scheduler.running
        all_decoding = len(running) == len(prompts) and not any(s.is_prefill for s in running)
        t0 = time.perf_counter()
        engine.step()
        if all_decoding:
            times.append(time.perf_counter() - t0)
    matchers = [s.grammar for s in engine.scheduler.running if s.grammar is not None]
    for s in list(engine.scheduler.running):
        engine.abort_request(s.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    return times, matchers


def sampler_steps(engine: LLMEngine, grammar, batch: int, steps: int) -> dict[str, list[float]]:
    """The sampler on one decode step's logits, 0 and 1 constrained rows interleaved call by call;
    the constrained row's matcher advances with each token it samples (new states, as in decoding)."""
    sampler, vocab = engine.runner.sampler, engine.model_config.vocab_size
    params = SamplingParams(temperature=0.8, seed=1)
    gen = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {"0 constrained": [], "1 constrained": [], "advance": []}
    matcher = grammar.matcher()
    for step in range(steps):
        logits = torch.randn(batch, vocab, generator=gen)
        plain = [SampleRow(params, 10 + step) for _ in range(batch)]
        for label, rows in (("0 constrained", plain), ("1 constrained", [SampleRow(params, 10 + step, grammar=matcher)]
                                                       + plain[1:])):
            t0 = time.perf_counter()
            out = sampler(logits, rows)
            times[label].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        matcher.advance(out.token_ids[0])
        times["advance"].append(time.perf_counter() - t0)
        if matcher.is_complete:
            matcher = grammar.matcher()
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    engine = LLMEngine(EngineConfig(max_num_seqs=args.batch, enable_prefix_caching=False))
    tok = engine.tokenizer
    compiler = GrammarCompiler(tok.backend_json(), engine.model_config.vocab_size, tok.eos_token_ids)
    prompts = [tok.encode(f"Request {i}: describe the with statement in a few words.") for i in range(args.batch)]
    plain = SamplingParams(temperature=0.8, seed=1, max_tokens=args.steps + 8, ignore_eos=True)
    grammar = compiler.json_schema(SCHEMA)
    constrained = SamplingParams(temperature=0.8, seed=1, max_tokens=args.steps + 8, ignore_eos=True, grammar=grammar)

    decode_steps(engine, prompts, [plain] * args.batch, 5)  # warm-up
    configs = [("0 constrained", [plain] * args.batch),
               ("1 constrained", [constrained] + [plain] * (args.batch - 1))]
    timed: dict[str, list[float]] = {label: [] for label, _ in configs}
    for r in range(args.rounds):  # ABBA...: neither configuration always runs second
        for label, params in configs if r % 2 == 0 else configs[::-1]:
            timed[label] += decode_steps(engine, prompts, params, args.steps)[0]
    rows = [("engine step", label, statistics.median(t) * 1e3, len(t)) for label, t in timed.items()]
    sampled = sampler_steps(engine, grammar, args.batch, args.steps * args.rounds)
    rows += [("sampler call", label, statistics.median(sampled[label]) * 1e3, len(sampled[label]))
             for label in ("0 constrained", "1 constrained")]
    print(f"decode, batch {args.batch}, embedded model (vocab {engine.model_config.vocab_size}), CPU, 1 thread\n")
    print("| what | constrained rows (of 16) | median ms | samples |")
    print("|---|---|---|---|")
    for what, label, ms, n in rows:
        print(f"| {what} | {label} | {ms:.3f} | {n} |")
    engine_delta, sampler_delta = rows[1][2] - rows[0][2], rows[3][2] - rows[2][2]
    print(f"\none constrained row: engine step {engine_delta:+.2f} ms, sampler call {sampler_delta * 1e3:+.0f} µs "
          f"(its mask computed and applied), matcher advance {statistics.median(sampled['advance']) * 1e6:.0f} µs")

if __name__ == "__main__":
    main()
