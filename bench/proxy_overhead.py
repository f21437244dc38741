"""What the proxy costs: requests/s at 64 clients, added latency p50/p99, CPU per request.

Starts, on loopback, two fake nodes (P and D) and the real proxy (``python -m proxy``), each in
its own process, then measures, for non-streamed and for streamed requests:
  1. latency of sequential requests (one client) straight to the fake D vs through the proxy
     (the proxy sends both legs, P and D, for each); "added" is the difference at p50 and p99,
     and the proxy's CPU time per request over that run;
  2. requests/s with ``--concurrency`` (64) keep-alive clients for ``--seconds``, from a load
     generator in a process of its own (uvloop when installed), straight to D and through the
     proxy, and the proxy's CPU time (user + system, /proc) per request over that run.
CPU per request is the figure to judge a change by on a shared machine: requests/s moves with
whatever else runs, CPU time much less; a single-threaded proxy tops out near 1 / (CPU per request).
The fakes and the load generator speak raw HTTP/1.1 over asyncio so they cost next to nothing.
A streamed answer is 16 token events (each with the token-id note a pdserve node sends), a
finish event and [DONE], written at once. Goals (issue 31, 2 cores): >= 3,000 non-streamed
requests/s, added p50 <= 0.5 ms, p99 <= 2 ms.

    .venv/bin/python bench/proxy_overhead.py [--requests 500] [--concurrency 64] [--seconds 4]
    .venv/bin/python bench/proxy_overhead.py --profile /tmp/proxy.raw  # py-spy of the non-stream run

Where the proxy's time goes: see "Proxy overhead" in README.md (a py-spy profile by layer).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_LENGTH = re.compile(rb"(?i)content-length:\s*(\d+)")
_ANSWER = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
                      "choices": [{"index": 0, "text": " world, how are you", "finish_reason": "length"}],
                      "usage": {"prompt_tokens": 2, "completion_tokens": 16, "total_tokens": 18}}).encode()
_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
             + str(len(_ANSWER)).encode() + b"\r\n\r\n" + _ANSWER)


def _event(i: int, finish: str | None) -> bytes:
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": " w", "logprobs": None, "finish_reason": finish}]}
    return f": pdserve-ids 0 {100 + i}\ndata: {json.dumps(chunk, separators=(',', ':'))}\n\n".encode()


_SSE = b"".join(_event(i, "length" if i == 15 else None) for i in range(16)) + b"data: [DONE]\n\n"
_STREAM_RESPONSE = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
                    + f"{len(_SSE):x}\r\n".encode() + _SSE + b"\r\n0\r\n\r\n")
_BODIES = {False: json.dumps({"model": "m", "prompt": "hello", "max_tokens": 16}).encode(),
           True: json.dumps({"model": "m", "prompt": "hello", "max_tokens": 16, "stream": True}).encode()}


class _FakeNode(asyncio.Protocol):
    """Answers every request on a keep-alive connection with one fixed completion (SSE if asked)."""

    def connection_made(self, transport: asyncio.Transport) -> None:
        self.transport, self.buf = transport, b""

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            match = _LENGTH.search(self.buf, 0, end)
            total = end + 4 + (int(match.group(1)) if match else 0)
            if len(self.buf) < total:
                return
            stream = b'"stream":true' in self.buf[end:total].replace(b" ", b"")
            self.buf = self.buf[total:]
            self.transport.write(_STREAM_RESPONSE if stream else _RESPONSE)


async def _serve_fake(port: int) -> None:
    server = await asyncio.get_running_loop().create_server(_FakeNode, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


class _Conn:
    """One keep-alive HTTP/1.1 connection issuing POSTs back to back."""

    def __init__(self, port: int, stream: bool):
        body = _BODIES[stream]
        self.port, self.stream = port, stream
        self.request = (f"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\n"
                        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n").encode() + body

    async def open(self) -> _Conn:
        self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        return self

    async def call(self) -> None:
        self.writer.write(self.request)
        head = await self.reader.readuntil(b"\r\n\r\n")
        if not head.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"bad answer: {head[:80]!r}")
        if (length := _LENGTH.search(head)) is not None:
            await self.reader.readexactly(int(length.group(1)))
            return
        body = await self.reader.readuntil(b"\r\n0\r\n\r\n")  # chunked: SSE never holds \r\n\r\n
        if b"data: [DONE]" not in body or b'{"error"' in body:
            raise RuntimeError(f"bad stream: {body[-200:]!r}")

    def close(self) -> None:
        self.writer.close()


async def latencies(port: int, n: int, stream: bool) -> list[float]:
    conn = await _Conn(port, stream).open()
    for _ in range(min(50, n)):  # warm up: pools filled, code paths hot
        await conn.call()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await conn.call()
        out.append(time.perf_counter() - start)
    conn.close()
    return out


async def throughput(port: int, concurrency: int, seconds: float, stream: bool) -> dict:
    """Requests/s over ``seconds`` after 0.5 s of warm-up, and all requests sent (warm-up too)."""
    conns = [await _Conn(port, stream).open() for _ in range(concurrency)]
    done = total = 0
    stop_at = time.perf_counter() + 0.5 + seconds
    measure_from = stop_at - seconds

    async def worker(conn: _Conn) -> None:
        nonlocal done, total
        while (now := time.perf_counter()) < stop_at:
            await conn.call()
            total += 1
            if now >= measure_from:
                done += 1

    await asyncio.gather(*(worker(c) for c in conns))
    for c in conns:
        c.close()
    return {"rps": done / seconds, "total": total}


def _run_load(port: int, concurrency: int, seconds: float, stream: bool) -> dict:
    """The throughput run in a process of its own, so the generator's CPU is not the bench's."""
    out = subprocess.run([sys.executable, __file__, "--load-gen", str(port), "--concurrency", str(concurrency),
                          "--seconds", str(seconds)] + (["--stream"] if stream else []),
                         capture_output=True, text=True, check=True, cwd=ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _fast_loop() -> None:
    try:
        import uvloop
    except ImportError:
        return
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(port: int, path: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
                s.sendall(f"GET {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n".encode())
                if s.recv(64).startswith(b"HTTP/1.1 200"):
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"nothing answered 200 on port {port}{path}")


def _cpu_s(pid: int) -> float:
    """User+system CPU seconds of a process (Linux /proc); 0 elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _pct(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100)[q - 1] if q < 100 else max(values)


def _measure(args, proxy_pid: int, d_port: int, proxy_port: int, stream: bool) -> dict:
    direct = asyncio.run(latencies(d_port, args.requests, stream))
    cpu_before = _cpu_s(proxy_pid)
    proxied = asyncio.run(latencies(proxy_port, args.requests, stream))
    cpu_one_ms = (_cpu_s(proxy_pid) - cpu_before) * 1e3 / (args.requests + min(50, args.requests))
    direct_load = _run_load(d_port, args.concurrency, args.seconds, stream)
    spy = None
    if args.profile and (not stream or args.modes == "stream"):
        spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(proxy_pid), "-d",
                                str(int(args.seconds) + 1), "-r", "400", "-f", "raw", "-o", args.profile, "--nonblocking"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    cpu_before = _cpu_s(proxy_pid)
    proxy_load = _run_load(proxy_port, args.concurrency, args.seconds, stream)
    cpu_ms = (_cpu_s(proxy_pid) - cpu_before) * 1e3 / proxy_load["total"]
    if spy is not None:
        spy.wait()
    return {"direct": direct, "proxied": proxied, "direct_rps": direct_load["rps"], "proxy_rps": proxy_load["rps"],
            "cpu_ms": cpu_ms, "cpu_one_ms": cpu_one_ms}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=500, help="sequential requests per latency run")
    ap.add_argument("--concurrency", type=int, default=64, help="clients in the throughput run")
    ap.add_argument("--seconds", type=float, default=4.0, help="length of each throughput run")
    ap.add_argument("--dispatch", default="concurrent", choices=["concurrent", "prefill_first"])
    ap.add_argument("--log-level", default="info", help="the proxy's log level (info logs every request)")
    ap.add_argument("--modes", default="non-stream,stream", help="which runs: non-stream, stream or both")
    ap.add_argument("--profile", help="py-spy raw profile of the proxy during the non-stream throughput run")
    ap.add_argument("--serve-fake", type=int, help=argparse.SUPPRESS)  # internal: be a fake node
    ap.add_argument("--load-gen", type=int, help=argparse.SUPPRESS)  # internal: be the load generator
    ap.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_fake:
        _fast_loop()
        asyncio.run(_serve_fake(args.serve_fake))
        return
    if args.load_gen:
        _fast_loop()
        print(json.dumps(asyncio.run(throughput(args.load_gen, args.concurrency, args.seconds, args.stream))))
        return

    p_port, d_port, proxy_port = _free_port(), _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env, "cwd": ROOT}
    procs = [subprocess.Popen([sys.executable, __file__, "--serve-fake", str(p)], **quiet) for p in (p_port, d_port)]
    procs.append(subprocess.Popen(
        [sys.executable, "-m", "proxy", "--port", str(proxy_port), "--registry-port", "0",
         "--static-prefill", f"127.0.0.1:{p_port}@127.0.0.1:14579", "--static-decode",
         f"127.0.0.1:{d_port}@127.0.0.1:14580", "--dispatch", args.dispatch, "--log-level", args.log_level],
        **quiet))
    try:
        _wait_http(proxy_port, "/ready")
        _wait_http(d_port, "/")
        runs = {mode: _measure(args, procs[-1].pid, d_port, proxy_port, mode == "stream")
                for mode in args.modes.split(",")}
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
    _report(args, runs)


def _report(args, runs: dict[str, dict]) -> None:
    print(f"proxy overhead ({os.cpu_count()} CPUs, dispatch={args.dispatch}, log-level={args.log_level}, "
          f"{args.requests} sequential requests, {args.concurrency} clients x {args.seconds:g} s)\n")
    print("| mode | proxy CPU / request (ms), 64 clients | one client | requests/s direct | requests/s proxy "
          "| added p50 (ms) | added p99 (ms) | goal met |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for mode, r in runs.items():
        added50 = (_pct(r["proxied"], 50) - _pct(r["direct"], 50)) * 1e3
        added99 = (_pct(r["proxied"], 99) - _pct(r["direct"], 99)) * 1e3
        met = r["proxy_rps"] >= 3000 and added50 <= 0.5 and added99 <= 2.0
        print(f"| {mode} | {r['cpu_ms']:.3f} | {r['cpu_one_ms']:.3f} | {r['direct_rps']:,.0f} | {r['proxy_rps']:,.0f} | {added50:.3f} "
              f"| {added99:.3f} | {'yes' if met else 'no'} (>= 3,000/s, <= 0.5, <= 2) |")


if __name__ == "__main__":
    main()
