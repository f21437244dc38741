"""Decode and prefill speed on one GPU against transformers and the memory floor (issue 9).

For each shape (random weights: their values do not change speed) it writes a bf16 checkpoint
made on the GPU with transformers' ``from_config``, then measures in the same run:
- decode ms/step at each batch size = (time for ``long`` new tokens - time for ``short``) /
  (``long`` - ``short``), prompts of 128 random token ids, greedy, ``ignore_eos``: the
  difference cancels prefill and start-up;
- the same for transformers ``generate`` on the same checkpoint (one batch, equal lengths);
- TTFT of a 2,048-token prompt (one output token, one prefill step);
- the floor: a device-to-device copy's bandwidth (bytes read + written), and the bytes one
  decode step must read (weights + the batch's KV) divided by it;
- with ``--batch-invariant both``, each engine again with ``--batch-invariant`` (issue 34): its
  decode steps and TTFT beside the default's, as output tokens/s and the mode's cost.
Prints one markdown table, with the issue's goals; ``--json PATH`` also writes the figures
there (bench/gpu_check.py reads them). ``--make-checkpoints`` only writes the checkpoints into
``--workdir`` (each gets a tokenizer that names every id, ``t123``, so a server's text shows
exactly which tokens it generated). Without CUDA it says so and exits 0.

    python bench/gpu_engine.py [--shapes qwen2.5-0.5b,llama3.1-8b] [--batches 1,16,64]
                               [--eager] [--no-transformers] [--workdir DIR] [--ttft-tokens 2048]
                               [--json PATH] [--make-checkpoints] [--batch-invariant off|on|both]
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

PROMPT_LEN = 128
TTFT_LEN = 2048

SHAPES: dict[str, dict] = {
    "qwen2.5-0.5b": dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
        max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True,
    ),
    "llama3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 8192},
        rope_theta=500000.0,
    ),
}
# ms per decode step the issue asks for: (batch 1, batch 64), and TTFT of 2,048 tokens on the 8B shape
GOALS = {"qwen2.5-0.5b": {1: 2.0, 64: 4.0}, "llama3.1-8b": {1: 8.0, 64: 12.0}}
TTFT_GOAL_MS = {"llama3.1-8b": 70.0}


def make_checkpoint(name: str, workdir: Path) -> Path:
    """A random-weight bf16 checkpoint of shape ``name``, made on the GPU (seconds, not minutes).

    Written beside its final name and renamed into place: a run killed half-way (a timeout)
    leaves no directory that looks complete, and the next run makes it again."""
    import transformers

    path = workdir / name
    if (path / "config.json").is_file():
        return path
    partial = workdir / f".{name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    spec = dict(SHAPES[name])
    config = transformers.AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(partial, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    write_id_tokenizer(partial, spec["vocab_size"])
    partial.rename(path)
    return path


def write_id_tokenizer(path: Path, vocab_size: int) -> None:
    """A word-level tokenizer naming each id ``t<id>``: prompts stay token ids, and a server's
    completion text ("t5 t77 ...") says exactly which tokens came out, so two servers' answers
    compare token for token."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 131072}))


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    n = 20
    t0 = time.perf_counter()
    for _ in range(n):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * src.numel() * n / (time.perf_counter() - t0)


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def prompts(batch: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab) for _ in range(length)] for _ in range(batch)]


def engine_rows(path: Path, name: str, args, bandwidth: float, eager: bool,
                invariant: bool = False) -> tuple[list[dict], dict]:
    """Decode ms/step at each of ``args.batches`` with its floor, and what the engine is (its TTFT too)."""
    from common.engine.config import EngineConfig
    from common.engine.llm_engine import LLMEngine
    from common.engine.sampling_params import SamplingParams

    config = EngineConfig(
        model=str(path), device="cuda", max_num_seqs=max(args.batches, default=1),
        max_num_batched_tokens=max(args.ttft_tokens, TTFT_LEN), max_model_len=4096,
        kv_cache_memory_gb=args.kv_cache_gb, enforce_eager=eager, batch_invariant=invariant,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    start_s = time.perf_counter() - t0
    cfg = engine.model_config
    weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
    kv_per_token = engine.kv_layout.bytes_per_block_per_layer() * cfg.num_layers / engine.kv_layout.block_size
    short, long = args.new_tokens

    def run(batch: int, n: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        outs = engine.generate(prompts(batch, PROMPT_LEN, cfg.vocab_size), params)
        assert all(len(o) == n for o in outs)

    rows = []
    for batch in args.batches:
        run(batch, short)  # warm-up: kernels compiled, allocator settled
        ms = (timed(lambda: run(batch, long)) - timed(lambda: run(batch, short))) / (long - short) * 1e3
        kv_bytes = batch * (PROMPT_LEN + (short + long) / 2) * kv_per_token
        rows.append(dict(shape=name, batch=batch, graphs=not eager, invariant=invariant, ms_per_step=ms,
                         floor_ms=(weight_bytes + kv_bytes) / bandwidth * 1e3,
                         goal_ms=GOALS[name].get(batch), transformers_ms=None))
    ttft_ms = None
    if args.ttft_tokens:
        one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
        # a new prompt each time: a repeated one is a prefix-cache hit (one token computed, not a prefill)
        fresh = (prompts(1, args.ttft_tokens, cfg.vocab_size, seed=seed) for seed in itertools.count(1))
        engine.generate(next(fresh), one)
        ttft_ms = min(timed(lambda: engine.generate(next(fresh), one)) for _ in range(3)) * 1e3
    graphs = engine.runner.graphs
    linears = {(m.triton, m.large_from) for m in engine.runner.model.modules() if hasattr(m, "triton")}
    (use_triton, large_from), = linears or {(None, None)}
    info = dict(shape=name, graphs=not eager, invariant=invariant, start_s=start_s,
                linears="default" if use_triton is None else "row tiles" if not use_triton else "triton" + (
                    f" (128-row tiles from {large_from} rows)" if large_from is not None else ""), ttft_tokens=args.ttft_tokens, ttft_ms=ttft_ms,
                ttft_goal_ms=TTFT_GOAL_MS.get(name), graph_sizes=graphs.sizes if graphs else None,
                backend=engine.runner.attn_backend.name, graph_mib=engine.runner.graph_memory_bytes / 2**20,
                weight_bytes=weight_bytes)
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return rows, info


def transformers_ms(path: Path, batches: list[int], args) -> dict[int, float]:
    """transformers ``generate`` ms/step at each batch size, measured like the engine's."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).to("cuda").eval()
    model.generation_config.eos_token_id = None
    short, long = args.new_tokens
    result = {}
    for batch in batches:
        ids = torch.tensor(prompts(batch, PROMPT_LEN, model.config.vocab_size), device="cuda")

        def gen(n: int) -> None:
            with torch.inference_mode():
                model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                               min_new_tokens=n, pad_token_id=0)

        gen(short)
        result[batch] = (timed(lambda: gen(long)) - timed(lambda: gen(short))) / (long - short) * 1e3
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return result


def measure(args, workdir: Path) -> dict:
    """Every shape's engine (and, with ``--eager``, its eager twin) and transformers: one dict."""
    bandwidth = copy_bandwidth()
    results: dict = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, copy_bandwidth_Bps=bandwidth,
                         decode=[], engines=[])
    for name in args.shapes.split(","):
        path = make_checkpoint(name, workdir)
        modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.batch_invariant]
        for eager, invariant in [(e, i) for e in ((False, True) if args.eager else (False,)) for i in modes]:
            rows, info = engine_rows(path, name, args, bandwidth, eager, invariant)
            results["decode"] += rows
            results["engines"].append(info)
        if not args.no_transformers and args.batches:
            hf_ms = transformers_ms(path, args.batches, args)
            for row in results["decode"]:
                if row["shape"] == name:
                    row["transformers_ms"] = hf_ms.get(row["batch"])
    results["invariant_cost"] = invariant_cost(results)
    return results


def render(results: dict) -> str:
    """The markdown table of decode steps (graphs, beside eager and transformers), then a note per engine."""
    def fmt(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}"

    lines = [
        f"GPU: {results['gpu']}; torch {results['torch']}; "
        f"device-to-device copy {results['copy_bandwidth_Bps'] / 1e12:.2f} TB/s (read + write)",
        "",
        "| shape | batch | engine ms/step | eager ms/step | transformers ms/step | floor ms | engine / floor | goal |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    eager = {(r["shape"], r["batch"]): r["ms_per_step"] for r in results["decode"]
             if not r["graphs"] and not r["invariant"]}
    for r in (r for r in results["decode"] if r["graphs"] and not r["invariant"]):
        goal = r["goal_ms"]
        verdict = "-" if goal is None else f"<= {goal} ms: {'met' if r['ms_per_step'] <= goal else 'NOT met'}"
        lines.append(f"| {r['shape']} | {r['batch']} | {r['ms_per_step']:.2f} | "
                     f"{fmt(eager.get((r['shape'], r['batch'])))} | {fmt(r['transformers_ms'])} | "
                     f"{r['floor_ms']:.2f} | {r['ms_per_step'] / r['floor_ms']:.1f}x | {verdict} |")
    lines.append("")
    for info in results["engines"]:
        ttft = ""
        if info["ttft_ms"] is not None:
            ttft = f"TTFT of {info['ttft_tokens']} tokens {info['ttft_ms']:.1f} ms"
            if info["ttft_goal_ms"] is not None:
                met = "met" if info["ttft_ms"] <= info["ttft_goal_ms"] else "NOT met"
                ttft += f" (goal <= {info['ttft_goal_ms']} ms: {met})"
            ttft += "; "
        mode = ", --batch-invariant" if info["invariant"] else ""
        lines.append(f"- {info['shape']}, {'CUDA graphs' if info['graphs'] else 'eager'}{mode}: {ttft}attention "
                     f"{info['backend']}, linears {info['linears']}; CUDA graphs {info['graph_sizes']} "
                     f"({info['graph_mib']:.0f} MiB); engine start {info['start_s']:.1f} s")
    lines += invariant_table(results)
    return "\n".join(lines)


def invariant_cost(results: dict) -> list[dict]:
    """Per shape and batch (and TTFT): the default's and ``--batch-invariant``'s figures, and the
    mode's cost in output tokens/s (decode) or time (TTFT); empty unless both modes ran."""
    out = []
    rows = {(r["shape"], r["batch"], r["invariant"]): r for r in results["decode"] if r["graphs"]}
    for (shape, batch, invariant), r in rows.items():
        if not invariant and (shape, batch, True) in rows:
            base, mode = r["ms_per_step"], rows[shape, batch, True]["ms_per_step"]
            out.append(dict(shape=shape, what=f"decode, batch {batch}", default=batch / base * 1e3,
                            invariant=batch / mode * 1e3, unit="tok/s", cost=1 - base / mode))
    engines = {(e["shape"], e["invariant"]): e for e in results["engines"] if e["graphs"] and e["ttft_ms"]}
    for (shape, invariant), e in engines.items():
        if not invariant and (shape, True) in engines:
            base, mode = e["ttft_ms"], engines[shape, True]["ttft_ms"]
            out.append(dict(shape=shape, what=f"TTFT, {e['ttft_tokens']} tokens", default=base, invariant=mode,
                            unit="ms", cost=mode / base - 1))
    return out


def invariant_table(results: dict) -> list[str]:
    cost = invariant_cost(results)
    if not cost:
        return []
    lines = ["", "| shape | measure | default | --batch-invariant | cost |", "|---|---|---:|---:|---:|"]
    for c in cost:
        lines.append(f"| {c['shape']} | {c['what']} | {c['default']:.1f} {c['unit']} | {c['invariant']:.1f} "
                     f"{c['unit']} | {c['cost']:.0%} |")
    return lines


def make_checkpoints(names: list[str], workdir: Path) -> dict:
    made = []
    for name in names:
        t0 = time.perf_counter()
        path = make_checkpoint(name, workdir)
        size = sum(f.stat().st_size for f in path.glob("*.safetensors"))
        made.append(dict(shape=name, path=str(path), bytes=size, seconds=time.perf_counter() - t0))
        print(f"{name}: {path} ({size / 1e9:.2f} GB of weights) in {made[-1]['seconds']:.1f} s", flush=True)
    return {"checkpoints": made}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, from {', '.join(SHAPES)}")
    ap.add_argument("--batches", default="1,16,64", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="decode batch sizes; empty (--batches=) measures only TTFT")
    ap.add_argument("--new-tokens", default="16,80", type=lambda s: [int(x) for x in s.split(",")],
                    help="the two generation lengths whose time difference gives ms/step")
    ap.add_argument("--ttft-tokens", type=int, default=TTFT_LEN, help="prompt length for TTFT; 0 skips it")
    ap.add_argument("--kv-cache-gb", type=float, default=8.0)
    ap.add_argument("--eager", action="store_true", help="also measure the engine with --enforce-eager")
    ap.add_argument("--no-transformers", action="store_true")
    ap.add_argument("--workdir", default=None, help="where checkpoints go (default: a temporary directory)")
    ap.add_argument("--make-checkpoints", action="store_true", help="only write the checkpoints into --workdir")
    ap.add_argument("--json", default=None, metavar="PATH", help="also write the figures here as JSON")
    ap.add_argument("--batch-invariant", choices=("off", "on", "both"), default="off",
                    help="engines with --batch-invariant: off, on, or both (the mode's cost, issue 34)")
    ap.add_argument("--tier-copy", action="store_true",
                    help="also the KV host tier's copy bandwidth against a pinned copy_ (bench/kv_tier_copy.py)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("CUDA is not available: bench/gpu_engine.py measures GPU decode speed; nothing measured.")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(args.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        if args.make_checkpoints:
            results = make_checkpoints(args.shapes.split(","), workdir)
        else:
            results = measure(args, workdir)
            print(render(results))
            if args.tier_copy:
                from kv_tier_copy import measure as tier_copy

                results["tier_copy"] = tier_copy(torch.device("cuda"), "qwen2.5-0.5b", blocks=256, repeats=5)
                print("KV host tier / pinned copy_: down {ratio_down:.2f}, up {ratio_up:.2f} (goal >= {goal})"
                      .format(**results["tier_copy"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
