"""Host-tier copy bandwidth: the KV tiers' own copies against a pinned ``copy_`` of the same bytes.

    python bench/kv_tier_copy.py [--device cuda] [--shape qwen2.5-0.5b] [--blocks 256] [--repeats 5]

Down: ``KVTiers.offload_many`` of ``--blocks`` pool blocks into the host tier (one gather per
layer, one device-to-host copy into pinned memory), timed until its event says the bytes are on
the host. Up: the same blocks found again (``lookup``) and copied back into other pool blocks
(``start_load``), timed until the device is done. The reference is one ``copy_`` of the same
number of bytes between a contiguous device tensor and a pinned host one, each way. Issue 35's
goal on a GPU: the tier's bandwidth >= 70 % of the reference's, both ways. On CPU (``--device
cpu``) the pool already is host memory and the host tier is off by default; the run only
checks the code path and its numbers mean little. Prints a table; ``--json PATH`` writes it too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.engine.kv_tiers import KVTiers  # noqa: E402
from common.kv_layout import KVLayout  # noqa: E402

GOAL = 0.70
# (layers, kv heads, head dim): the KV of the 0.5B and 8B shapes gpu_check uses
SHAPES = {"qwen2.5-0.5b": (24, 2, 64), "llama3.1-8b": (32, 8, 128)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(device: torch.device, shape: str, blocks: int, repeats: int, block_size: int = 16,
            one_allocation: bool = True, own_stream: bool = True) -> dict:
    """``one_allocation``: every layer's cache a slice of one tensor, as the model runner makes the
    pool (the tiers copy any blocks in one kernel); else a tensor per layer (one kernel per layer).
    ``own_stream``: the tier's copies on its copy stream (the engine's way), else on the current one.
    One ``KVTiers`` for every round, as an engine keeps it (a new one per round would also measure a
    new stream's first allocations); it holds two rounds' blocks, so each round evicts the one
    before last."""
    layers, heads, head_dim = SHAPES[shape]
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    layout = KVLayout(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, block_size=block_size, dtype=dtype)
    if one_allocation:
        caches = list(torch.randn((layers, *layout.layer_shape(2 * blocks)), device=device)
                      .to(layout.torch_dtype).unbind(0))
    else:
        caches = [torch.randn(layout.layer_shape(2 * blocks), device=device).to(layout.torch_dtype)
                  for _ in range(layers)]
    nbytes = blocks * sum(c[:, 0].nbytes for c in caches)
    src, dst = list(range(blocks)), list(range(blocks, 2 * blocks))
    down, up, ref_down, ref_up = [], [], [], []
    tiers = KVTiers(caches, host_bytes=2 * nbytes, file_tier=None)
    if not own_stream:
        tiers.copy_stream = None
    for r in range(repeats + 1):  # the first round warms the allocators up
        hashes = [(r * blocks + b).to_bytes(8, "little") for b in src]
        sync(device)
        t0 = time.perf_counter()
        tiers.offload_many(src, hashes)
        sync(device)
        t1 = time.perf_counter()
        found = tiers.lookup(hashes)
        assert len(found) == blocks, f"the host tier holds {len(found)} of {blocks} blocks"
        filled = tiers.start_load(f"bench-{r}", hashes, found, dst)
        sync(device)
        t2 = time.perf_counter()
        assert filled == blocks, filled
        for c in caches[:2]:
            assert torch.equal(c[:, src], c[:, dst]), "a block came back different"
        dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
        sync(device)
        t3 = time.perf_counter()
        host.copy_(dev, non_blocking=True)
        sync(device)
        t4 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync(device)
        t5 = time.perf_counter()
        if r:
            down.append(t1 - t0)
            up.append(t2 - t1)
            ref_down.append(t4 - t3)
            ref_up.append(t5 - t4)
    gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in
            (("tier_down", down), ("tier_up", up), ("copy_down", ref_down), ("copy_up", ref_up))}
    return {"device": str(device), "shape": shape, "blocks": blocks, "bytes": nbytes, "one_allocation": one_allocation,
            "own_stream": own_stream, **gbps,
            "ratio_down": gbps["tier_down"] / gbps["copy_down"], "ratio_up": gbps["tier_up"] / gbps["copy_up"],
            "goal": GOAL}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    ap.add_argument("--blocks", type=int, default=256, help="blocks moved each way per round")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", metavar="PATH", help="also write the figures here")
    args = ap.parse_args()
    rows = [measure(torch.device(args.device), args.shape, args.blocks, args.repeats, one_allocation=one,
                    own_stream=own) for one, own in ((True, True), (True, False), (False, True))]
    r = rows[0]
    print(f"{r['blocks']} blocks of {args.shape} ({r['bytes'] / 1e6:.1f} MB) on {r['device']}, medians of "
          f"{args.repeats}\n")
    print("| pool | direction | host tier GB/s | pinned copy_ GB/s | ratio | goal |")
    print("|---|---|---:|---:|---:|---:|")
    for row in rows:
        pool = ("one allocation" if row["one_allocation"] else "a tensor per layer") + \
            (", copy stream" if row["own_stream"] else ", current stream")
        pool += " (the engine's)" if row["one_allocation"] and row["own_stream"] else ""
        for way, label in (("down", "pool -> host tier"), ("up", "host tier -> pool")):
            ratio = row[f"ratio_{way}"]
            print(f"| {pool} | {label} | {row[f'tier_{way}']:.2f} | {row[f'copy_{way}']:.2f} | {ratio:.2f} | "
                  f">= {GOAL:.2f} {'(met)' if ratio >= GOAL else '(NOT met)'} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
