"""Role flips under load: how long a flip takes (the drain apart) and whether any request fails.

A keyed proxy and ``--prefill`` + ``--decode`` flippable daemons (``pdserve prefill|decode``, CPU,
one thread each, the embedded model unless ``--model``); ``--clients`` closed-loop clients send
greedy completions (streamed and not, in turn; ``--max-tokens`` each) through the proxy the whole
time. Meanwhile ``--flips`` flips go one after the other, ``--pause-s`` apart: the second prefill
node to decode and back, then the second decode node to prefill and back, and so on (never the
last node of a role). Each flip waits until the proxy sees the new counts. Reported: the node's
``flip_s`` (swap + re-registration) and ``drain_s`` p50 / p99 / max, the client's wall time per
flip, requests done and failed, and answers that differ from the first answer to the same prompt.

    flock /tmp/pdserve-bench.lock .venv/bin/python bench/role_flip.py --flips 20
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from common.cluster_auth import ClusterKey  # noqa: E402
from helpers.cluster import Proc, start, stop_all  # noqa: E402
from helpers.flippable import flip, start_flippable  # noqa: E402
from helpers.stats import pct  # noqa: E402

PROMPTS = ["The quick brown fox", "Once upon a time", "A B C D E F G", "In the beginning there was",
           "Four score and seven years ago", "It was a dark and stormy night"]


class Clients:
    """Closed-loop clients; every answer is compared with the first one to its prompt (greedy)."""

    def __init__(self, url: str, clients: int, max_tokens: int) -> None:
        self.url, self.max_tokens = url, max_tokens
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.done, self.failed, self.mismatched = 0, [], 0
        self.first: dict[str, str] = {}
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(clients)]

    def _run(self, i: int) -> None:
        with httpx.Client(timeout=120) as http:
            n = i
            while not self.stop.is_set():
                prompt, stream = PROMPTS[n % len(PROMPTS)], n % 2 == 0
                try:
                    text = self._one(http, prompt, stream)
                    with self.lock:
                        self.done += 1
                        if self.first.setdefault(prompt, text) != text:
                            self.mismatched += 1
                except Exception as exc:  # noqa: BLE001 - counted and shown
                    with self.lock:
                        self.done += 1
                        self.failed.append(f"{prompt!r} stream={stream}: {exc}"[:300])
                n += 1

    def _one(self, http: httpx.Client, prompt: str, stream: bool) -> str:
        body = {"prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": stream}
        if not stream:
            r = http.post(self.url + "/v1/completions", json=body)
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code} {r.text[:200]}")
            return r.json()["choices"][0]["text"]
        parts = []
        with http.stream("POST", self.url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"{r.status_code} {r.read()[:200]!r}")
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"error event {event['error']}")
                    parts.append(event["choices"][0]["text"])
        return "".join(parts)


def counts(proxy: Proc) -> dict:
    return httpx.get(proxy.url + "/ready", timeout=5).json().get("nodes", {})


def wait_counts(proxy: Proc, want: dict, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while counts(proxy) != want:
        if time.monotonic() > deadline:
            raise RuntimeError(f"the proxy sees {counts(proxy)}, not {want}")
        time.sleep(0.01)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flips", type=int, default=20)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prefill", type=int, default=2)
    ap.add_argument("--decode", type=int, default=2)
    ap.add_argument("--pause-s", type=float, default=0.3, help="between flips: requests flow through the new roles")
    ap.add_argument("--model", default="embedded", help="embedded, default (SmolLM2-135M-Instruct), a directory "
                    "or a .gguf")
    args = ap.parse_args()
    if args.prefill < 2 or args.decode < 2:
        ap.error("--prefill and --decode must be at least 2: a flip never takes the last node of a role")
    tmp = Path(tempfile.mkdtemp(prefix="pdserve-role-flip-"))
    key = ClusterKey.load(ClusterKey.generate(tmp / "cluster.key"))
    keyed = ("--cluster-key-file", str(tmp / "cluster.key"))
    procs: list[Proc] = []
    try:
        proxy = start("proxy", tmp, *keyed, "--migration-limit", "3", wait=False)
        procs.append(proxy)
        model = ("--model", args.model) if args.model != "default" else ()  # default: what a node serves unset
        node = (*keyed, "--proxy", f"127.0.0.1:{proxy.kv_port}", "--heartbeat-interval-s", "0.5", *model)
        prefills = [start_flippable("prefill", tmp, *node, name=f"p{i}") for i in range(args.prefill)]
        decodes = [start_flippable("decode", tmp, *node, name=f"d{i}") for i in range(args.decode)]
        procs += prefills + decodes
        for p in procs:
            p.wait_ready()
        base = {"P": args.prefill, "D": args.decode}
        wait_counts(proxy, base, 30)
        clients = Clients(proxy.url, args.clients, args.max_tokens)
        for t in clients.threads:
            t.start()
        time.sleep(1.0)  # warm: every node has served a few
        flip_s, drain_s, wall_s, aborted = [], [], [], 0
        epochs: dict[str, int] = {}
        for i in range(args.flips):
            swing, back = divmod(i, 2)
            node_, role = (prefills[-1], ("decode", "prefill")[back]) if swing % 2 == 0 else \
                (decodes[-1], ("prefill", "decode")[back])
            t0 = time.perf_counter()
            r = flip(node_, key, role, epochs.get(node_.name, 0))  # the epoch known: no scrape timed
            wall_s.append(time.perf_counter() - t0)
            if r.status_code != 200:
                raise RuntimeError(f"flip {i} of {node_.name} to {role}: {r.status_code} {r.text}")
            out = r.json()
            epochs[node_.name] = out["epoch"]
            flip_s.append(out["flip_s"])
            drain_s.append(out["drain_s"])
            aborted += out["aborted"]
            shift = 0 if back else (-1 if node_ in prefills else 1)
            wait_counts(proxy, {"P": base["P"] + shift, "D": base["D"] - shift})
            time.sleep(args.pause_s)
        time.sleep(1.0)
        clients.stop.set()
        for t in clients.threads:
            t.join(timeout=120)
        ms = lambda xs, q: f"{pct(xs, q / 100) * 1000:.1f}"  # noqa: E731
        print(f"flips: {args.flips} ({args.prefill}P + {args.decode}D, {args.clients} clients, "
              f"{args.max_tokens} tokens each, model {args.model})")
        print(f"flip_s (drain apart) ms: p50 {ms(flip_s, 50)}  p99 {ms(flip_s, 99)}  max {max(flip_s) * 1000:.1f}")
        print(f"drain_s ms:              p50 {ms(drain_s, 50)}  p99 {ms(drain_s, 99)}  max {max(drain_s) * 1000:.1f}")
        print(f"client wall per flip ms: p50 {ms(wall_s, 50)}  p99 {ms(wall_s, 99)}  max {max(wall_s) * 1000:.1f}")
        print(f"requests: {clients.done} done, {len(clients.failed)} failed, {clients.mismatched} answers differed; "
              f"{aborted} ended at a drain timeout")
        for line in clients.failed[:10]:
            print("  failed:", line)
    finally:
        stop_all(procs)


if __name__ == "__main__":
    main()
